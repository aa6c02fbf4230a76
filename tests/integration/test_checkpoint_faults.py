"""Checkpoints under faults, with the seed's command lines: a run killed mid-checkpoint resumes on another
worker count to exactly uninterrupted training (leftovers ignored and cleaned, the last K kept), and a
write error on one rank ends every rank with that rank and cause named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.mlp import assert_params_close, mlp_job, reference_params
from model_parallel.runtime.checkpoint.commit import ENOSPC_ENV, STALL_ENV
from model_parallel.runtime.checkpoint.store import latest_step, list_checkpoints, load_checkpoint
from model_parallel.runtime.launch import LocalWorld, launch_workers, worker_commands

PEER_TIMEOUT = 30  # --timeout of every worker
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def args(plan: Path, steps: int, checkpoints: Path, *extra: object) -> list[str]:
    return ["--model", "mlp", "--plan", str(plan), "--steps", str(steps), "--batch_size", "8", "--num_microbatches", "4",
            "--lr", "0.01", "--checkpoint_dir", str(checkpoints), "--checkpoint_every", "2",
            "--timeout", str(PEER_TIMEOUT), *map(str, extra)]


def test_kill9_mid_checkpoint_then_resume_on_fewer_workers_is_exact(tmp_path: Path) -> None:
    _, plan3 = mlp_job(tmp_path, 3, name="plan3.json")
    _, plan2 = mlp_job(tmp_path, 2, name="plan2.json")
    checkpoints = tmp_path / "ck"
    # 3 workers checkpoint steps 1 and 3; in step 3's checkpoint every rank has written its shard and
    # stops before the commit (a test hook, so the kill lands at a known point, not a timed one).
    with LocalWorld(worker_commands(args(plan3, 100_000, checkpoints), 3), env={STALL_ENV: "3"}) as world:
        for rank in range(3):
            world.wait_for_line(rank, r"stalled in checkpoint step 3 after the shard write", timeout=150)
        for rank in range(3):
            world.kill(rank)
        world.wait(timeout=30)
    step3 = checkpoints / "step_3"
    assert sorted(p.name for p in step3.iterdir()) == [f"shard_{r}.{x}" for r in range(3) for x in ("json", "safetensors")]
    assert latest_step(checkpoints) == 1 and list_checkpoints(checkpoints) == [1]
    # What a kill inside a file write leaves besides: temporary files, here and in the committed step.
    (checkpoints / "step_1" / ".shard_0.safetensors.k1ll3d.tmp").write_bytes(b"half a shard")
    (checkpoints / ".latest.k1ll3d.tmp").write_text("step_")

    # Resume on 2 workers: their step-3 checkpoint must not take rank 2's stale shard for its own
    # (it once failed: "'_10.weight' is in the shards of rank 1 and rank 2", the others blaming rank 0).
    total = 6  # resumed at step 2; checkpoints 3 and 5
    resumed = launch_workers(args(plan2, total, checkpoints, "--resume", "--keep_checkpoints", 2), 2, timeout=200)
    assert resumed.ok, resumed.summary()
    assert [w.returncode for w in resumed.workers] == [0, 0]
    assert "resumed from" in resumed.output(0) and "at step 2" in resumed.output(0), resumed.summary()
    assert latest_step(checkpoints) == total - 1
    assert_params_close(load_checkpoint(checkpoints).params(), reference_params(total), "run resumed on 2 workers")
    manifest = json.loads((step3 / "manifest.json").read_text())
    assert [s["rank"] for s in manifest["shards"]] == [0, 1]
    # --keep_checkpoints 2: exactly the newest two step directories, and no leftover anywhere.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_3", "step_5"]
    assert sorted(p.name for p in step3.iterdir()) == ["graph.json", "manifest.json", "shard_0.json", "shard_0.safetensors", "shard_1.json", "shard_1.safetensors"]
    assert not list(checkpoints.rglob("*.tmp"))


def test_write_error_on_one_rank_stops_every_rank_naming_it(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    result = launch_workers(args(plan, 4, checkpoints), 2, timeout=200, env={ENOSPC_ENV: "1"})
    assert not result.timed_out, result.summary()
    expected = "checkpoint write failed on rank 1: [Errno 28] No space left on device"
    for rank in range(2):
        output = result.output(rank)
        assert result.workers[rank].returncode == 2, result.summary()
        errors = [line for line in output.splitlines() if "error:" in line]
        assert len(errors) == 1 and expected in errors[0], f"rank {rank}:\n{output[-3000:]}"
        assert "shard_1.safetensors" in errors[0] and "no checkpoint of step 1 was committed" in errors[0], errors[0]
        assert "stopped responding" not in output and "Traceback" not in output, output[-3000:]
    assert latest_step(checkpoints) is None and not list(checkpoints.rglob("manifest.json"))
