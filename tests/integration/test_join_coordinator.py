"""`--join` under a coordinator (issue 36, "a join followed by a rebalance"): a worker started later is admitted into
a `--recover --coordinator` job at a step boundary; the coordinator learns the new membership (generation 1, a
world of 3) and the joiner is a spare in the plan the job ran (`ctl status` lists it so) until `ctl scale --workers
3` gives it a share, moved to it live. The run ends with the parameters of uninterrupted single-process training
(1e-5) and every process exits 0. `MP_TEST_JOIN_AT_STEP` keeps rank 0 from admitting before step 4 (the joiner
starts with the job), so the admission lands mid-run whatever the machine's speed."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from model_parallel.cli.ctl import format_status
from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import LocalWorld, free_port, join_command, worker_commands
from support.mlp import assert_params_close, reference_params
from support.recovery_jobs import TOKEN, poll, release, worker_args, write_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
torch.set_num_threads(1)


def test_a_joiner_under_a_coordinator_is_a_spare_until_ctl_scale_gives_it_a_share(tmp_path: Path) -> None:
    steps = 240  # the job must outlive the admission, the status polls and the scale request
    graph, plan = write_job(tmp_path, 2)
    port = free_port()
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        args = worker_args(plan, steps, tmp_path / "ck", coord.address)
        joiner = join_command(f"127.0.0.1:{port}", args)
        commands = worker_commands([*args, "--recover"], 2, port=port) + [joiner]
        with LocalWorld(commands, env={"MP_TEST_JOIN_AT_STEP": "4"}) as world:
            # Ranks 0 and 1 reported a step of the new world (a spare's stage stays None in its reports).
            joined = poll(coord, world, lambda s: s["generation"] == 1 and len(s["workers"]) == 3
                          and all(w["status"] == "running" for w in s["workers"])
                          and [w["stage"] for w in sorted(s["workers"], key=lambda w: w["rank"])][:2] == [0, 1])
            version = joined["plan_version"]
            coord.ctl("scale", workers=3)
            scaled = poll(coord, world, lambda s: s["plan_version"] == version + 1 and s["pending_version"] is None
                          and all(w["stage"] is not None and w["plan_version"] == version + 1 for w in s["workers"]))
            release(coord, world)
            result = world.wait(timeout=240)
        assert not result.timed_out, result.summary()
        assert [w.returncode for w in result.workers] == [0, 0, 0], result.summary()
        assert coord.wait(timeout=30) == 0, coord.output()[-3000:]
    # Admitted as a spare: the world of 3 ran the 2-rank plan the job ran (a new version), the joiner without a stage.
    assert joined["world_size"] == 3 and len(joined["plan"]["stages"]) == 2, joined
    assert sorted((w["rank"], w["stage"]) for w in joined["workers"]) == [(0, 0), (1, 1), (2, None)], joined["workers"]
    [change] = joined["recoveries"]
    assert (change["joined"], change["lost"], change["members"]) == ([2], [], [0, 1, 2]), change
    text = format_status(joined)
    assert "original rank(s) [2] joined (spares); a world of 3 (original ranks [0, 1, 2])" in text, text
    assert " spare " in text, text
    assert len(scaled["plan"]["stages"]) == 3, scaled["plan"]
    log = coord.output()
    assert "membership generation 1: original rank(s) [2] joined; a world of 3" in log, log[-3000:]
    assert f"plan v{version + 1} is live" in log, log[-3000:]
    for rank in range(3):
        output = result.output(rank)
        assert "admission 1: original rank 2 joined from 127.0.0.1; new world of 3" in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "run with a join and a scale")


def _joiner_killed(tmp_path: Path, steps: int, env: dict[str, str], generation: int) -> tuple[Any, str]:
    """Two members under a manual coordinator and a joiner admitted at step 4 that dies (how: `env`): the world's
    result (members exit 0, the joiner -9) and the coordinator's log. Once the two members run as membership
    `generation`, the rest of the job runs unslowed (`release`)."""
    graph, plan = write_job(tmp_path, 2)
    port = free_port()
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        args = worker_args(plan, steps, tmp_path / "ck", coord.address)
        commands = worker_commands([*args, "--recover"], 2, port=port) + [join_command(f"127.0.0.1:{port}", args)]
        with LocalWorld(commands, env={"MP_TEST_JOIN_AT_STEP": "4", **env}) as world:
            poll(coord, world, lambda s: s["generation"] == generation and sorted(
                w["rank"] for w in s["workers"] if w["status"] == "running") == [0, 1])
            release(coord, world)
            result = world.wait(timeout=240)
        assert not result.timed_out, result.summary()
        assert [w.returncode for w in result.workers] == [0, 0, -signal.SIGKILL], result.summary()
        assert coord.wait(timeout=30) == 0, coord.output()[-3000:]
        return result, coord.output()


def test_a_joiner_lost_after_being_taken_under_a_coordinator_the_members_go_on_as_the_next_generation(
        tmp_path: Path) -> None:
    """The joiner dies between rank 0 taking its request and the meeting (`MP_TEST_JOINER_DIES`): the members close
    the new world without it after 3 T, register as generation 1 with the same members, and finish exactly."""
    steps = 60
    result, log = _joiner_killed(tmp_path, steps, {"MP_TEST_JOINER_DIES": "1"}, generation=1)
    for rank in (0, 1):
        output = result.output(rank)
        assert "original rank 2 did not come to generation 1 within 15 s: training on without it" in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert "membership generation 1: original rank(s) [] lost; the survivors re-formed a world of 2" in log
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "a lost joiner")


def test_the_spare_killed_after_its_admission_the_members_recover_as_generation_2(tmp_path: Path) -> None:
    """A spare is a member like any other: its kill -9 is a failure the others survive (generation 2, the even
    split of the 2 that are left), exact."""
    steps = 60
    result, log = _joiner_killed(tmp_path, steps, {"MP_TEST_SIGNAL_AT_STEP": "2:12:KILL"}, generation=2)
    for rank in (0, 1):
        output = result.output(rank)
        assert "admission 1: original rank 2 joined" in output, output[-3000:]
        assert "recovery 2: lost original rank(s) [2]; new world of 2 (original ranks [0, 1]" in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert "membership generation 1: original rank(s) [2] joined" in log, log[-3000:]
    assert "membership generation 2: original rank(s) [2] lost; the survivors re-formed a world of 2" in log, log[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "a spare lost")
