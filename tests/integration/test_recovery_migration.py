"""A worker killed in the middle of a live plan switch under `--recover --coordinator` (issue 36, "a kill during a
live migration"): the layers moved, the new stage not yet live on any rank. The survivors must not keep the
half-moved plan: they re-form the world, restore the last committed checkpoint (taken before the switch) with the
even split for their count, and the coordinator serves that plan, not the one that was mid-switch; the run ends
with the parameters of uninterrupted single-process training (1e-5) and exit 0. The kill comes from the test
hook `MP_TEST_SIGNAL_AT_STEP=<rank>:switch:KILL` (cli/worker_recover.py: as the rank builds the switched stage)."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import LocalWorld, worker_commands
from support.mlp import assert_params_close, reference_params
from support.recovery_jobs import TOKEN, poll, release, worker_args, write_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
torch.set_num_threads(1)


def test_a_kill_during_a_live_migration_the_survivors_recover_from_the_checkpoint_not_the_half_moved_plan(
        tmp_path: Path) -> None:
    steps = 120
    graph, plan = write_job(tmp_path, 3)
    moved = json.loads(plan.read_text())  # one layer from rank 1's stage to rank 0's: ranks 0 and 1 exchange layers
    moved["stages"][0]["node_ids"].append(moved["stages"][1]["node_ids"].pop(0))
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        args = worker_args(plan, steps, tmp_path / "ck", coord.address, "--recover")
        with LocalWorld(worker_commands(args, 3), env={"MP_TEST_SIGNAL_AT_STEP": "1:switch:KILL"}) as world:
            poll(coord, world, lambda s: len(s["workers"]) == 3 and min(w["step"] for w in s["workers"]) >= 2)
            coord.ctl("set-plan", plan=moved)  # plan v1: original rank 1 dies in it, its layers already sent
            status = poll(coord, world, lambda s: s["generation"] == 1 and len(s["workers"]) == 2
                          and all(w["step"] >= 0 and w["status"] == "running" for w in s["workers"]))
            release(coord, world)
            result = world.wait(timeout=240)
        assert not result.timed_out, result.summary()
        assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0], result.summary()
        assert coord.wait(timeout=30) == 0, coord.output()[-3000:]
    # The coordinator serves the survivors' even split, above the version that was mid-switch, and nothing pending.
    assert status["world_size"] == 2 and status["pending_version"] is None, status
    assert status["plan_version"] >= 2 and len(status["plan"]["stages"]) == 2, status
    assert [s["ranks"] for s in status["plan"]["stages"]] == [[0], [1]], status["plan"]
    [mid_switch] = [h for h in status["history"] if h["version"] == 1]
    assert "applied_at_step" not in mid_switch and "original rank(s) [1] lost" in mid_switch["abandoned"], mid_switch
    [recovery] = status["recoveries"]
    assert (recovery["lost"], recovery["members"]) == ([1], [0, 2]), recovery
    for rank in (0, 2):
        output = result.output(rank)
        assert "rank 1 stopped responding" in output, output[-3000:]
        assert "recovery 1: lost original rank(s) [1]; new world of 2 (original ranks [0, 2]" in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        assert "switched to plan v1" not in output, output[-3000:]  # the half-moved plan never went live
    assert "signal 9 in a plan switch, its layers moved" in result.output(1), result.output(1)[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "run recovered mid-switch")
