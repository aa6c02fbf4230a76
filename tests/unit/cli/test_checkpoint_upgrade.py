"""`model-parallel checkpoint-upgrade DIR`: a checkpoint an earlier version wrote (torch-pickle shards, refused by every
reader) converted once, by the user's explicit choice, to safetensors shards that read back the same."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from model_parallel.cli import main as entry
from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint import store as ckpt

PARAMS = {"fc.weight": torch.randn(2, 3), "fc.bias": torch.randn(2).bfloat16()}
STATE = {"fc.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}}
EXTRA = {"rng": torch.get_rng_state(), "betas": (0.9, 0.999), 3: [math.inf]}


def _old_checkpoint(root: Path, step: int) -> None:
    """Shards as earlier versions wrote them: torch.save of the payload as shard_<rank>.pt, recorded so."""
    for rank in (0, 1):
        params = {f"r{rank}.{k}": v for k, v in PARAMS.items()}
        path = ckpt.save_shard(root, step, rank, params, {"b": torch.arange(3)} if rank else None,
                               {f"r{rank}.{k}": v for k, v in STATE.items()}, EXTRA)
        old = path.with_suffix(".pt")
        torch.save({"params": params, "buffers": {"b": torch.arange(3)} if rank else {},
                    "optimizer": {f"r{rank}.{k}": v for k, v in STATE.items()}, "extra": EXTRA}, old)
        path.unlink()
        data = old.read_bytes()
        index = json.loads(path.with_suffix(".json").read_text())
        index.update(file=old.name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        path.with_suffix(".json").write_text(json.dumps(index))
    ckpt.finalize(root, step, {"world_size": 2}, None)


def _run(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        entry.main(["checkpoint-upgrade", *argv])
    return exit_.value.code


def test_an_old_checkpoint_is_refused_then_converted_once_and_reads_the_same(tmp_path: Path, capsys) -> None:
    _old_checkpoint(tmp_path, 4)
    _old_checkpoint(tmp_path, 6)
    with pytest.raises(CheckpointError, match=r"as torch pickles, which this version does not read .* "
                                              rf"model-parallel checkpoint-upgrade {tmp_path}$"):
        ckpt.load_checkpoint(tmp_path)
    assert _run(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "step_4/shard_0.pt -> shard_0.safetensors" in out and "converted 4 shard(s)" in out
    assert not list(tmp_path.rglob("*.pt"))
    for step in (4, 6):
        checkpoint = ckpt.load_checkpoint(tmp_path, step)
        assert all(torch.equal(checkpoint.params([f"r1.{k}"])[f"r1.{k}"], v) for k, v in PARAMS.items())
        assert torch.equal(checkpoint.buffers(["b"])["b"], torch.arange(3))
        state = checkpoint.optimizer_state(["r0.fc.weight"])["r0.fc.weight"]
        assert torch.equal(state["exp_avg"], STATE["fc.weight"]["exp_avg"]) and state["step"].item() == 3.0
        extra = checkpoint.shard_extra(0)
        assert extra["betas"] == (0.9, 0.999) and extra[3] == [math.inf] and torch.equal(extra["rng"], EXTRA["rng"])
        index = json.loads((tmp_path / f"step_{step}" / "shard_1.json").read_text())
        data = (tmp_path / f"step_{step}" / "shard_1.safetensors").read_bytes()
        assert index["file"] == "shard_1.safetensors" and index["sha256"] == hashlib.sha256(data).hexdigest()
    assert _run(str(tmp_path)) == 0 and "every shard is safetensors already" in capsys.readouterr().out


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    assert _run(str(tmp_path / "nope")) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert _run(str(tmp_path)) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    _old_checkpoint(tmp_path, 1)
    shard = tmp_path / "step_1" / "shard_0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, another sha256: not loaded
    assert _run(str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sha256 differs from manifest.json; it was not loaded" in err[0]
    assert shard.is_file() and not (tmp_path / "step_1" / "shard_0.safetensors").exists()
