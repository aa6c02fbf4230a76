"""`--recover` under the schedules of several stages per rank (interleaved, zbinterleaved, zbv), which run microbatches
in rounds of the world size: a re-formed world whose size divides m runs the same schedule on its default plan; one
where the schedule cannot run (interleaved: m not a multiple of the world; zero bubble: m not in equal rounds, or one
rank) runs the one-stage-per-rank flush schedule with the same updates (interleaved -> 1f1b, zbv -> zbh1), says so in
one line on every rank, and its checkpoints still record the schedule asked for; an admission (`--join`) makes the same
choice for the grown world, the joiner included (zbv on 3 with m = 4: zbv). Either way the run ends with the parameters and losses of uninterrupted single-process training (cli/recover_schedule.py)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import LocalWorld, free_port, join_command, worker_commands
from support.recovery import args, assert_exact, recoveries, run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _training(tmp_path: Path) -> dict:
    return dict(load_checkpoint(tmp_path / "ck").extra["training"])


def test_interleaved_on_4_losing_one_runs_1f1b_on_3_then_interleaved_again_on_2_exactly(tmp_path: Path) -> None:
    # Checkpoints of steps 1, 3, 5, 7; original rank 1 dies as step 5 begins (3 survivors: 1f1b), original rank 3 as
    # step 8 begins (2 survivors divide m=8: interleaved again, on their loop plan).
    result = run(tmp_path, "1:5:KILL,3:8:KILL", world_size=4,
                 extra=("--schedule", "interleaved", "--num_microbatches", "8"))
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0, -signal.SIGKILL], result.summary()
    for rank in (0, 2):
        output = result.output(rank)
        assert output.count("schedule interleaved cannot run on this world of 3 (interleaved 1F1B runs microbatches in "
                            "rounds of p=3: m=8 is not a multiple of p): this world runs 1f1b") == 1, \
            output[-3000:]
        assert output.count("this world runs") == 1, output[-3000:]  # the world of 2 runs interleaved: no line
        assert "survived 2 failure(s)" in output.strip().splitlines()[-1], output[-3000:]
        assert [(e["lost"], e["world"]) for e in recoveries(tmp_path, rank)] == [([1], [0, 2, 3]), ([3], [0, 2])]
    # Step 5 was the 3-rank world's: it records the schedule asked for, so a resume with the run's flags is no change.
    training = dict(load_checkpoint(tmp_path / "ck", 5).extra["training"])
    assert (training["schedule"], training["schedule_running"]) == ("interleaved", "1f1b"), training
    assert _training(tmp_path)["schedule_running"] == "interleaved"
    assert_exact(tmp_path, [0, 2], micro=8)


def test_zbv_on_3_losing_one_runs_zbv_on_2_exactly(tmp_path: Path) -> None:
    result = run(tmp_path, "2:5:KILL", world_size=3,
                 extra=("--schedule", "zbv", "--batch_size", "12", "--num_microbatches", "6"))
    assert [w.returncode for w in result.workers] == [0, 0, -signal.SIGKILL], result.summary()
    for rank in (0, 1):
        output = result.output(rank)
        assert "this world runs" not in output, output[-3000:]  # 2 divides m=6: zbv again, its V on 2 ranks
        assert "survived 1 failure(s)" in output.strip().splitlines()[-1], output[-3000:]
    training = _training(tmp_path)
    assert (training["schedule"], training["schedule_running"]) == ("zbv", "zbv"), training
    assert_exact(tmp_path, [0, 1], batch=12, micro=6)


def test_an_admission_into_zbv_on_2_with_m_4_runs_zbv_on_3_the_joiner_too(tmp_path: Path) -> None:
    # ZBV runs any m on any world of >= 2 (its rounds are not m % world: the stand-in zbh1 ran here before, its
    # line naming a rule ZBV does not have); the grown world re-cuts its V for 3 ranks, the joiner included.
    port = free_port()
    # --timeout 10: the joiner starts with the job and must be ready by the admission step (tests/integration/test_join.py)
    job = args(tmp_path / "ck", tmp_path, extra=("--schedule", "zbv", "--timeout", "10"))
    with LocalWorld(worker_commands(job, 2, port=port) + [join_command(f"127.0.0.1:{port}", job)],
                    env={"MP_TEST_JOIN_AT_STEP": "4"}) as world:
        result = world.wait(timeout=200)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 0, 0], result.summary()
    for rank in range(3):
        output = result.output(rank)
        assert "this world runs" not in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    training = _training(tmp_path)
    assert (training["schedule"], training["schedule_running"]) == ("zbv", "zbv"), training
    assert_exact(tmp_path, [0, 1])  # the joiner ran only the steps after its admission
