"""How workers end after a failure of their own: a layer that fails at run time, a corrupt checkpoint under
--resume. Every rank says the same cause in one line (no traceback, no peer blamed for "stopping"), exits with a
documented code, and its last line names the latest committed checkpoint and the command that resumes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from model_parallel.runtime.checkpoint.store import latest_step
from model_parallel.runtime.launch import launch_workers
from support.mlp import mlp_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
TRAIN = ["--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01", "--timeout", "30"]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error:" in line]


def test_a_layer_failing_at_run_time_is_one_line_on_every_rank(tmp_path: Path) -> None:
    graph, plan = mlp_job(tmp_path, 2)
    data = json.loads(graph.read_text())
    node = next(n for n in data["nodes"] if n["id"] == "_10")  # on stage 1: its input has 128 features, not 64
    node["layer"]["module"] = "torch.nn.Linear(in_features=64, out_features=128, bias=True)"
    graph.write_text(json.dumps(data))
    checkpoints = tmp_path / "ck"
    result = launch_workers(["--graph", str(graph), "--plan", str(plan), "--steps", "3", "--checkpoint_dir",
                             str(checkpoints), *TRAIN], 2, timeout=200)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [3, 5], result.summary()
    cause = "[rank 1 stage 1] failed while training: RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    for rank in range(2):
        output = result.output(rank)
        errors = error_lines(output)
        assert len(errors) == 1 and cause in errors[0], f"rank {rank}:\n{output[-3000:]}"
        assert "Traceback" not in output and "stopped responding" not in output, output[-3000:]
        last = output.strip().splitlines()[-1]
        assert f"[rank {rank}] no checkpoint was committed in {checkpoints}; rerun to start over:" in last, last
    assert "rank 1 failed: " in error_lines(result.output(0))[0]


def test_a_corrupt_shard_under_resume_names_the_reading_rank_on_every_rank(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    base = ["--model", "mlp", "--plan", str(plan), "--checkpoint_dir", str(checkpoints), *TRAIN]
    first = launch_workers([*base, "--steps", "2"], 2, timeout=200)
    assert first.ok, first.summary()
    step = latest_step(checkpoints)
    shard = checkpoints / f"step_{step}" / "shard_1.safetensors"
    shard.unlink()
    os.mkfifo(shard)  # a read would block forever
    result = launch_workers([*base, "--steps", "4", "--resume"], 2, timeout=200)
    assert not result.timed_out, result.summary()
    want = f"restoring the checkpoint failed on rank 1: {shard}: the shard of rank 1 is not a regular file"
    for rank in range(2):
        output = result.output(rank)
        assert result.workers[rank].returncode == 2, result.summary()
        errors = error_lines(output)
        assert len(errors) == 1 and want in errors[0], f"rank {rank}:\n{output[-3000:]}"
        assert "Traceback" not in output and "stopped responding" not in output, output[-3000:]
        last = output.strip().splitlines()[-1]
        assert f"latest committed checkpoint: {checkpoints / f'step_{step}'}; once the error above is fixed" in last, last
        assert last.endswith("--resume") and "--steps 4" in last, last
