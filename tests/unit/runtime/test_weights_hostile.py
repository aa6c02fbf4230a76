"""Hostile `--weights` inputs: a FIFO or a symlink to a non-safetensors file is one InitError naming the file,
before any rank joins (never a blocked open or the safetensors library's own traceback)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model_parallel.cli.worker import build_parser, check_inputs
from model_parallel.errors import CheckpointError, InitError
from model_parallel.runtime.build.weights import INDEX, weight_source
from model_parallel.runtime.checkpoint.store import finalize, save_shard


def check(path: Path) -> None:
    check_inputs(build_parser().parse_args(["--model", "mlp", "--weights", str(path)]))


def test_a_fifo_as_model_safetensors_is_refused_before_joining(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(InitError, match=r"model\.safetensors \(named by .*\): not a regular file \(a FIFO"):
        check(tmp_path)
    with pytest.raises(InitError, match=r"--weights .*model\.safetensors: not a regular file"):
        check(tmp_path / "model.safetensors")


def write_index(directory: Path, file: str) -> None:
    (directory / INDEX).write_text(json.dumps({"weight_map": {"fc.weight": file}}))


def test_an_index_shard_symlinked_to_a_non_safetensors_file_is_one_error(tmp_path: Path) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_text("not tensors at all\n" * 10)
    (tmp_path / "model-00001.safetensors").symlink_to(junk)
    write_index(tmp_path, "model-00001.safetensors")
    check(tmp_path)  # the header is read on the rank that needs it; the file is a regular one
    source = weight_source(tmp_path)
    with pytest.raises(InitError, match=r"model-00001\.safetensors \(named by .*index\.json\): not a readable safetensors file"):
        source.read({"fc.weight": torch.zeros(2, 2)})


def test_an_index_shard_that_is_a_fifo_or_device_is_refused_before_joining(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model-00001.safetensors")
    write_index(tmp_path, "model-00001.safetensors")
    with pytest.raises(InitError, match=r"model-00001\.safetensors \(named by .*index\.json\): not a regular file"):
        check(tmp_path)
    (tmp_path / "model-00001.safetensors").unlink()
    (tmp_path / "model-00001.safetensors").symlink_to("/dev/zero")
    with pytest.raises(InitError, match=r"not a regular file"):
        check(tmp_path)


def test_a_good_file_still_reads(tmp_path: Path) -> None:
    save_file({"fc.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    check(tmp_path)
    assert torch.equal(weight_source(tmp_path).read({"fc.weight": torch.zeros(2, 2)})["fc.weight"], torch.ones(2, 2))


def test_weights_from_a_corrupt_checkpoint_name_the_manifest(tmp_path: Path) -> None:
    save_shard(tmp_path, 1, 0, {"fc.weight": torch.ones(2, 2)})
    finalize(tmp_path, 1, {}, None, expected_ranks=[0])
    manifest = tmp_path / "step_1" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["shards"][0]["file"] = ".."
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"manifest\.json: malformed manifest: shards\[0\]\.file must be a file name"):
        weight_source(tmp_path).read({"fc.weight": torch.zeros(2, 2)})



def test_an_index_naming_a_file_without_the_tensor_is_one_error(tmp_path: Path) -> None:
    """The index is data: a weight_map entry pointing at a file that lacks the tensor raised the safetensors
    library's untyped SafetensorError ("File does not contain tensor") from the rank building its stage."""
    save_file({"other.weight": torch.ones(2, 2)}, str(tmp_path / "model-00001.safetensors"))
    write_index(tmp_path, "model-00001.safetensors")
    with pytest.raises(InitError, match=r"model-00001\.safetensors: holds no tensor 'fc\.weight', which .*index\.json says"):
        weight_source(tmp_path).read({"fc.weight": torch.zeros(2, 2)})
