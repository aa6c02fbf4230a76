"""A token file changed under a running job (runtime/data/tokens.py): truncated, it killed the rank with SIGBUS and
no message (a memory map read past the new end); rewritten in place, later steps trained on other tokens than the
run started with. Both are a DataError naming the file and what to do; a file renamed over it keeps its old
contents behind the open descriptor, as before."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from model_parallel.errors import DataError
from model_parallel.runtime.data.sources import token_data

IDS = 1 << 14


def _write(path, ids) -> None:
    ids.astype(np.uint16).tofile(path)


def _opened(tmp_path):
    path = tmp_path / "train.bin"
    _write(path, np.arange(IDS) % 1000)
    data = token_data(str(path), seq_len=64, batch_size=8, seed=0)
    return path, data, data.batch(0)


def test_a_truncated_token_file_is_a_data_error_naming_it(tmp_path):
    path, data, _ = _opened(tmp_path)
    os.truncate(path, 4096)  # the old code's memory map: the next read past 4 KiB was SIGBUS, no message
    with pytest.raises(DataError, match=r"tokens:.*train.bin: the file changed while this run read it \(it is 4096 "
                                        rf"bytes now, {2 * IDS} when the run opened it\): a token file must not be "
                                        r"truncated or rewritten in place.*--resume"):
        for step in range(1, 5):
            data.batch(step)
    with pytest.raises(DataError, match="the file changed"):
        data.targets(1)  # the last stage's read of targets alone goes through the same check


def test_a_token_file_rewritten_in_place_is_refused_not_trained_on(tmp_path):
    path, data, _ = _opened(tmp_path)
    with open(path, "r+b") as f:  # the same size, other tokens, the same inode
        f.write((np.arange(IDS) % 7).astype(np.uint16).tobytes())
    seen = os.stat(path)
    os.utime(path, ns=(seen.st_atime_ns, seen.st_mtime_ns + 10**9))  # the clock's granularity must not hide the write
    with pytest.raises(DataError, match=r"train.bin: the file changed while this run read it \(its modification time "
                                        r"changed\)"):
        data.batch(1)


def test_a_token_file_renamed_over_keeps_the_run_on_the_tokens_it_started_with(tmp_path):
    path, data, first = _opened(tmp_path)
    _write(tmp_path / "copy.bin", np.arange(IDS) % 1000)
    reference = token_data(str(tmp_path / "copy.bin"), 64, 8, 0)
    _write(tmp_path / "new.bin", np.arange(IDS) % 7)
    os.replace(tmp_path / "new.bin", path)
    for step in range(4):
        assert torch.equal(data.batch(step)[1], reference.batch(step)[1])
    with pytest.raises(DataError, match="the file changed"):  # a copy opens the path again: another file now
        pickle.loads(pickle.dumps(data.dataset))[3]


def test_a_copy_of_a_token_dataset_reads_the_same_file_and_refuses_it_changed(tmp_path):
    path, data, _ = _opened(tmp_path)
    copied = pickle.dumps(data.dataset)
    assert torch.equal(pickle.loads(copied)[40][1], data.dataset[40][1])
    os.truncate(path, 4096)
    with pytest.raises(DataError, match="the file changed"):
        pickle.loads(copied)[40]
