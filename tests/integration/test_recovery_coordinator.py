"""Recovery with a coordinator (issue 36 items 1-2): `--recover --coordinator` survivors re-register as the next
membership generation and the coordinator's policy goes on with the new world; a coordinator killed with -9 and
started again on the same address learns the live job from the workers, which never stopped training. Both end
with the parameters of uninterrupted single-process training (1e-5). Steps are slowed (`--slowdown`, timing only)
so an operator's request lands while the job runs; a failure is injected at a known step (MP_TEST_SIGNAL_AT_STEP)."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import LocalWorld, free_port, worker_commands
from support.mlp import assert_params_close, reference_params
from support.recovery_jobs import TOKEN, poll, release, worker_args, write_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
torch.set_num_threads(1)


def test_recover_under_a_coordinator_the_survivors_are_the_next_generation_and_a_rebalance_works(tmp_path: Path) -> None:
    # Enough steps that the job outlives the two status polls and the scale request on a quiet machine too
    # (at 40 steps a run at ~80 steps/s finished before the test saw plan v2 go live).
    steps = 240
    graph, plan = write_job(tmp_path, 3)
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        args = worker_args(plan, steps, tmp_path / "ck", coord.address, "--recover")
        with LocalWorld(worker_commands(args, 3), env={"MP_TEST_SIGNAL_AT_STEP": "1:5:KILL"}) as world:
            status = poll(coord, world, lambda s: s["generation"] == 1 and len(s["workers"]) == 2
                          and all(w["step"] >= 0 and w["status"] == "running" for w in s["workers"]))
            assert (status["world_size"], status["plan_version"]) == (2, 1), status
            [recovery] = status["recoveries"]
            assert (recovery["lost"], recovery["members"], recovery["from_step"]) == ([1], [0, 2], 4), recovery
            coord.ctl("scale", workers=1)  # the policy on the new world: everything onto (new) rank 0
            poll(coord, world, lambda s: s["plan_version"] == 2 and s["pending_version"] is None)
            release(coord, world)
            result = world.wait(timeout=180)
        assert not result.timed_out, result.summary()
        assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0], result.summary()
        assert coord.wait(timeout=30) == 0, coord.output()[-3000:]
    log = coord.output()
    assert ("membership generation 1: original rank(s) [1] lost; the survivors re-formed a world of 2 (original ranks "
            "[0, 2]) from step 4; plan v1 (their even split) is live") in log, log[-3000:]
    assert "plan v2 is live" in log, log[-3000:]
    for rank in (0, 2):
        output = result.output(rank)
        assert "recovery 1: lost original rank(s) [1]; new world of 2 (original ranks [0, 2]" in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    final = json.loads((tmp_path / "coord" / "coordinator_status.json").read_text())
    assert final["generation"] == 1 and [r["lost"] for r in final["recoveries"]] == [[1]], final
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "recovered run")


def test_a_coordinator_killed_and_started_again_learns_the_live_job_and_rebalances(tmp_path: Path) -> None:
    steps = 360  # the job must outlive a coordinator's restart and its polls (see the first test)
    graph, plan = write_job(tmp_path, 2)
    even = json.loads(plan.read_text())
    moved = json.loads(plan.read_text())  # the same two ranks, one layer moved from stage 1 to stage 0
    moved["stages"][0]["node_ids"].append(moved["stages"][1]["node_ids"].pop(0))
    port = free_port()
    extra = ["--policy", "manual", "--port", str(port)]
    first = CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord1", extra=extra).start()
    try:
        args = worker_args(plan, steps, tmp_path / "ck", first.address)
        with LocalWorld(worker_commands(args, 2)) as world:
            poll(first, world, lambda s: len(s["workers"]) == 2 and min(w["step"] for w in s["workers"]) >= 2)
            first.ctl("set-plan", plan=moved)  # plan v1: the live plan a new coordinator must learn
            live = poll(first, world, lambda s: s["plan_version"] == 1 and s["pending_version"] is None)
            first.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            first.wait(timeout=10)
            with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord2", extra=extra) as second:
                learned = poll(second, world, lambda s: s["plan_version"] == 1 and sorted(
                    w["rank"] for w in s["workers"] if w["status"] == "running") == [0, 1], timeout=60)
                assert learned["plan"]["stages"] == live["plan"]["stages"], (learned["plan"], live["plan"])
                assert learned["learned"]["plan_version"] == 1, learned
                second.ctl("set-plan", plan=even)  # through the new coordinator: plan v2, above the live one
                poll(second, world, lambda s: s["plan_version"] == 2 and s["pending_version"] is None)
                release(second, world)
                result = world.wait(timeout=180)
                assert second.wait(timeout=30) == 0, second.output()[-3000:]
        assert not result.timed_out, result.summary()
        assert [w.returncode for w in result.workers] == [0, 0], result.summary()
    finally:
        first.close()
    log = second.output()
    assert "learned the live job from rank" in log and "plan v2 is live" in log, log[-3000:]
    for rank in (0, 1):
        output = result.output(rank)
        assert "lost the coordinator" in output and "reconnected to the coordinator" in output, output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "run across a coordinator restart")


def test_the_coordinator_and_a_worker_killed_together_a_new_coordinator_serves_the_reformed_world(tmp_path: Path) -> None:
    steps = 240  # the job must outlive a coordinator's restart and its polls (see the first test)
    graph, plan = write_job(tmp_path, 3)
    port = free_port()
    extra = ["--policy", "manual", "--port", str(port)]
    first = CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord1", extra=extra).start()
    try:
        args = worker_args(plan, steps, tmp_path / "ck", first.address, "--recover")
        with LocalWorld(worker_commands(args, 3), env={"MP_TEST_SIGNAL_AT_STEP": "1:8:KILL"}) as world:
            poll(first, world, lambda s: len(s["workers"]) == 3 and min(w["step"] for w in s["workers"]) >= 2)
            first.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            first.wait(timeout=10)
            # Original rank 1 dies at step 8, before or after this: either way the survivors re-form the world and
            # register with whichever coordinator listens (in the background while none does).
            with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord2", extra=extra) as second:
                status = poll(second, world, lambda s: s["generation"] == 1 and sorted(
                    w["rank"] for w in s["workers"] if w["status"] == "running") == [0, 1], timeout=90)
                assert status["world_size"] == 2 and status["recoveries"][0]["lost"] == [1], status
                version = status["plan_version"]
                second.ctl("scale", workers=1)
                poll(second, world, lambda s: s["plan_version"] == version + 1 and s["pending_version"] is None)
                release(second, world)
                result = world.wait(timeout=180)
                assert second.wait(timeout=30) == 0, second.output()[-3000:]
        assert not result.timed_out, result.summary()
        assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0], result.summary()
    finally:
        first.close()
    assert f"plan v{version + 1} is live" in second.output(), second.output()[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "recovered run")
