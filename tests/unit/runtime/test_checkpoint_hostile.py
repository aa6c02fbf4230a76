"""A hostile checkpoint corpus against the reader: every corruption is one CheckpointError naming the file and
the fix, never a traceback, an unbounded read, a blocked open or a silent wrong resume."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint.store import finalize, load_checkpoint, save_shard

PARAMS = {"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)}


def committed(root: Path, step: int = 3) -> Path:
    save_shard(root, step, 0, PARAMS, optimizer_state={"fc.weight": {"momentum_buffer": torch.ones(2, 3)}})
    finalize(root, step, {"world_size": 1}, None, expected_ranks=[0], extra={"next_step": step + 1})
    return root / f"step_{step}"


def edit_manifest(folder: Path, change: Callable[[dict], None]) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def read_all(root: Path) -> None:
    checkpoint = load_checkpoint(root)
    checkpoint.params()
    checkpoint.optimizer_state()


def test_an_intact_checkpoint_reads_back(tmp_path: Path) -> None:
    committed(tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.step == 3 and checkpoint.extra["next_step"] == 4
    assert torch.equal(checkpoint.params()["fc.weight"], PARAMS["fc.weight"])


def shard(index: int = 0) -> Callable[[dict], dict]:
    return lambda m: m["shards"][index]


@pytest.mark.parametrize("change, message", [
    (lambda m: shard()(m).update(file=".."), r"shards\[0\]\.file must be a file name in the step directory, found '\.\.'"),
    (lambda m: shard()(m).update(file=""), r"shards\[0\]\.file must be a file name"),
    (lambda m: shard()(m).update(file="shard_0.safetensors\x00"), r"shards\[0\]\.file must be a file name"),
    (lambda m: shard()(m).update(file="../step_1/shard_0.safetensors"), r"shards\[0\]\.file must be a file name"),
    (lambda m: m["extra"].update(next_step=1e300), r"extra\.next_step must be a whole number of steps in 0\.\.4 .*found '1e\+300'"),
    (lambda m: m["extra"].update(next_step=-5), r"extra\.next_step must be a whole number of steps in 0\.\.4"),
    (lambda m: m["extra"].update(next_step="10"), r"extra\.next_step must be a whole number"),
    (lambda m: m["extra"].update(next_step=10**30), r"extra\.next_step must be a whole number"),
    (lambda m: m.update(step=7), r"'step' is 7 but the directory is step_3"),
    (lambda m: shard()(m).update(bytes=-1), r"shards\[0\]\.bytes must be the shard's size"),
    (lambda m: shard()(m).update(bytes=10**30), r"shards\[0\]\.bytes must be the shard's size"),
    (lambda m: shard()(m).update(rank=-2), r"shards\[0\]\.rank must be a rank >= 0"),
    (lambda m: shard()(m)["params"].update({"fc.weight": "big"}), r"params\['fc\.weight'\] must be \[shape, dtype\]"),
    (lambda m: m["shards"].append(dict(m["shards"][0])), r"shards\[1\] repeats rank 0"),
    (lambda m: m.update(shards=[]), r"'shards' is empty"),
])
def test_a_malformed_manifest_field_is_one_error_naming_it(tmp_path: Path, change: Callable[[dict], None], message: str) -> None:
    folder = committed(tmp_path)
    edit_manifest(folder, change)
    with pytest.raises(CheckpointError, match=message) as caught:
        read_all(tmp_path)
    assert str(caught.value).startswith(str(folder / "manifest.json")) and "--resume then starts from the newest step still committed" in str(caught.value)


def test_a_shard_symlinked_to_dev_zero_is_refused_without_reading(tmp_path: Path) -> None:
    folder = committed(tmp_path)
    (folder / "shard_0.safetensors").unlink()
    (folder / "shard_0.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"shard_0\.safetensors: the shard of rank 0 is not a regular file .* it was not read"):
        read_all(tmp_path)


def test_a_fifo_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    folder = committed(tmp_path)
    (folder / "shard_0.safetensors").unlink()
    os.mkfifo(folder / "shard_0.safetensors")
    with pytest.raises(CheckpointError, match=r"not a regular file"):
        read_all(tmp_path)


def test_a_shard_longer_than_recorded_is_not_read(tmp_path: Path) -> None:
    folder = committed(tmp_path)
    with open(folder / "shard_0.safetensors", "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(CheckpointError, match=r"has \d+ bytes, the manifest records \d+; it was truncated or replaced"):
        read_all(tmp_path)


def rewrite_shard(folder: Path, payload: object) -> None:
    """Replace shard 0 by `payload`, with a manifest that matches it (so only the structure is wrong)."""
    import hashlib

    from safetensors.torch import save

    from model_parallel.runtime.checkpoint import shardio, skeleton

    structure, tensors = skeleton.encode(payload, "test")
    data = save({name: tensor for _, name, tensor in tensors},
                metadata={"format": shardio.FORMAT, "skeleton": json.dumps(structure)})
    (folder / "shard_0.safetensors").write_bytes(data)
    edit_manifest(folder, lambda m: shard()(m).update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))


@pytest.mark.parametrize("payload, message", [
    ([1, 2, 3], r"malformed \(a list, not the saved dictionary\)"),
    ({"params": [], "buffers": {}, "optimizer": {}, "extra": {}}, r"'params' is list, expected a dictionary"),
    ({"params": {"fc.weight": 1.0, "fc.bias": torch.zeros(2)}, "buffers": {}, "optimizer": {}, "extra": {}},
     r"params 'fc\.weight' is float, expected a tensor"),
    ({"params": {"fc.weight": torch.ones(5), "fc.bias": torch.zeros(2)}, "buffers": {}, "optimizer": {}, "extra": {}},
     r"'fc\.weight' has shape \[5\], the manifest records \[2, 3\]"),
    ({"params": dict(PARAMS), "buffers": {}, "optimizer": {"fc.weight": 3}, "extra": {}},
     r"optimizer state 'fc\.weight' is not a dictionary"),
])
def test_a_shard_payload_of_the_wrong_structure_is_one_error(tmp_path: Path, payload: object, message: str) -> None:
    folder = committed(tmp_path)
    rewrite_shard(folder, payload)
    with pytest.raises(CheckpointError, match=message):
        read_all(tmp_path)


def test_garbage_shard_bytes_are_one_line(tmp_path: Path) -> None:
    folder = committed(tmp_path)
    import hashlib

    data = b"\x10\0\0\0\0\0\0\0{not json}      " * 10
    (folder / "shard_0.safetensors").write_bytes(data)
    edit_manifest(folder, lambda m: shard()(m).update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
    with pytest.raises(CheckpointError, match=r"shard_0\.safetensors: cannot be read \(") as caught:
        read_all(tmp_path)
    assert "\n" not in str(caught.value)


def test_cleaning_up_leaves_the_files_of_a_malformed_manifest_alone(tmp_path: Path) -> None:
    from model_parallel.runtime.checkpoint.commit import prune

    folder = committed(tmp_path)
    edit_manifest(folder, lambda m: shard()(m).update(file=".."))
    assert prune(str(tmp_path)) == []  # it once deleted shard_0.safetensors, which the edited manifest no longer listed
    assert (folder / "shard_0.safetensors").is_file()


def test_a_full_disk_while_writing_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import model_parallel.fileio as fileio

    def full(fd: int) -> None:  # as a full disk fails a flush: errno and reason, but no file name
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*step_3/shard_0\.safetensors'"):
        save_shard(tmp_path, 3, 0, PARAMS)
