"""`--recover`: when a worker is lost (kill -9, SIGSTOP) the survivors re-form the world in the same processes,
restore the latest committed checkpoint and train every requested step, ending with the parameters (and, per
step, the losses) of uninterrupted single-process training — the oracle every pipeline run of the mlp meets,
so also the run resumed from that checkpoint on the new worker count. What cannot be survived ends with a
documented exit code and message. A rank is signalled by the test hook `MP_TEST_SIGNAL_AT_STEP` as its step
begins, so each failure happens at a known step (no race with how fast the steps run)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from model_parallel.runtime.launch import LocalWorld, free_port, worker_commands
from support.recovery import args, assert_exact, recoveries, run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_kill9_of_a_worker_survivors_continue_exactly(tmp_path: Path) -> None:
    result = run(tmp_path, "1:5:KILL")  # checkpoints of steps 1, 3 committed; step 4 done, then rank 1 dies
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0], result.summary()
    for rank in (0, 2):
        output = result.output(rank)
        assert "rank 1 stopped responding" in output, output[-3000:]
        assert ("recovery 1: lost original rank(s) [1]; new world of 2 (original ranks [0, 2]" in output
                and f"restored checkpoint step 3 from {tmp_path / 'ck'}; recomputed 1 step(s) (continued at step 4)"
                in output), output[-3000:]
        assert "survived 1 failure(s)" in output.strip().splitlines()[-1], output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        [event] = recoveries(tmp_path, rank)
        assert (event["lost"], event["world"], event["checkpoint_step"], event["recomputed"]) == ([1], [0, 2], 3, 1)
        assert event["seconds"] > 0
    assert_exact(tmp_path, [0, 2])


def test_kill9_of_rank0_the_store_host_the_lowest_survivor_hosts_the_next_store(tmp_path: Path) -> None:
    port = free_port()
    result = run(tmp_path, "0:5:KILL", port=port)
    assert [w.returncode for w in result.workers] == [-signal.SIGKILL, 0, 0], result.summary()
    for rank in (1, 2):
        output = result.output(rank)
        assert "rank 0 stopped responding (it hosts the rendezvous store" in output, output[-3000:]
        # The rule: original rank 1 (the lowest survivor) hosts generation 1's store at --dist_port + 1.
        assert f"new world of 2 (original ranks [1, 2], met at 127.0.0.1:{port + 1})" in output, output[-3000:]
    assert_exact(tmp_path, [1, 2])


def test_two_failures_in_a_row(tmp_path: Path) -> None:
    result = run(tmp_path, "1:3:KILL,2:7:KILL")  # the second one after the first recovery: a world of one
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, -signal.SIGKILL], result.summary()
    output = result.output(0)
    assert "recovery 1: lost original rank(s) [1]; new world of 2 (original ranks [0, 2]" in output, output[-3000:]
    assert "recovery 2: lost original rank(s) [2]; new world of 1 (original ranks [0]" in output, output[-3000:]
    assert "survived 2 failure(s)" in output.strip().splitlines()[-1], output[-3000:]
    assert [e["checkpoint_step"] for e in recoveries(tmp_path, 0)] == [1, 5]
    assert_exact(tmp_path, [0])


def test_a_second_failure_during_the_recovery_shrinks_the_new_world(tmp_path: Path) -> None:
    result = run(tmp_path, "1:5:KILL,2:recovery:KILL")  # original rank 2 dies before it registers
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, -signal.SIGKILL], result.summary()
    output = result.output(0)
    assert "recovery 1: lost original rank(s) [1, 2]; new world of 1 (original ranks [0]" in output, output[-3000:]
    assert_exact(tmp_path, [0])


def test_no_committed_checkpoint_ends_with_exit_3_and_the_command_that_starts_over(tmp_path: Path) -> None:
    result = run(tmp_path, "1:2:KILL", every=5)  # the first checkpoint would be step 4
    assert [w.returncode for w in result.workers] == [3, -signal.SIGKILL, 3], result.summary()
    for rank in (0, 2):
        output = result.output(rank)
        errors = [line for line in output.splitlines() if "error:" in line]
        assert len(errors) == 1 and "rank 1 stopped responding" in errors[0], output[-3000:]
        assert (f"cannot recover: no committed checkpoint in {tmp_path / 'ck'} to restore the stage of original "
                "rank(s) [1] from") in errors[0], output[-3000:]
        last = output.strip().splitlines()[-1]
        assert f"no checkpoint was committed in {tmp_path / 'ck'}; rerun to start over:" in last, last


def test_sigstop_then_sigcont_the_others_recover_the_stopped_one_is_told_it_was_replaced(tmp_path: Path) -> None:
    commands = worker_commands(args(tmp_path / "ck", tmp_path), 3)
    with LocalWorld(commands, env={"MP_TEST_SIGNAL_AT_STEP": "1:5:STOP"}) as world:
        world.wait_for_line(0, r"survived 1 failure", timeout=120)
        world.kill(1, signal.SIGCONT)  # back after the others moved on
        result = world.wait(timeout=60)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 6, 0], result.summary()
    stopped = result.output(1)
    assert "original rank 1 was declared lost and replaced in generation 1: it does not rejoin" in stopped, stopped[-3000:]
    assert "Traceback" not in stopped, stopped[-3000:]
    assert "to come back as a new worker (admitted at a step boundary): " in stopped and " --join 127.0.0.1:" in stopped, stopped[-3000:]
    assert "new world of 2 (original ranks [0, 2]" in result.output(2), result.output(2)[-3000:]
    assert_exact(tmp_path, [0, 2])


def test_sigstop_of_rank0_the_store_host_then_sigcont(tmp_path: Path) -> None:
    commands = worker_commands(args(tmp_path / "ck", tmp_path), 3)
    with LocalWorld(commands, env={"MP_TEST_SIGNAL_AT_STEP": "0:5:STOP"}) as world:
        world.wait_for_line(1, r"survived 1 failure", timeout=120)
        world.kill(0, signal.SIGCONT)
        result = world.wait(timeout=60)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [6, 0, 0], result.summary()
    # The survivors met at a store of their own (its host stood still): rank 0 finds no record there, and still
    # never rejoins.
    assert "original rank 0 was declared lost and replaced" in result.output(0), result.output(0)[-3000:]
    assert "new world of 2 (original ranks [1, 2]" in result.output(2), result.output(2)[-3000:]
    assert_exact(tmp_path, [1, 2])
