"""`--recover`: a second worker lost while the world re-forms — after it registered for the new generation and the
membership closed with it — leaves the new process group unformed; the others meet again one generation later from
that membership and train on, ending with the parameters and losses of uninterrupted single-process training
(runtime/wire/recovery.reform). The test hook's `reform` step signals a rank exactly there: no race with how fast
the world re-forms."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from model_parallel.runtime.launch import LocalWorld, free_port, worker_commands
from support.recovery import args, assert_exact, recoveries, run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_the_store_host_of_the_new_generation_stopped_as_it_forms_the_others_meet_again(tmp_path: Path) -> None:
    # Rank 0 (the store host) dies as step 5 begins; original rank 1, the lowest survivor, hosts generation 1's store
    # and stops once that membership closed with it. Ranks 2 and 3 find the group unformed, its store unreachable,
    # and meet at original rank 2's store (--dist_port + 2) as generation 2.
    port = free_port()
    commands = worker_commands(args(tmp_path / "ck", tmp_path), 4, port=port)
    with LocalWorld(commands, env={"MP_TEST_SIGNAL_AT_STEP": "0:5:KILL,1:reform:STOP"}) as world:
        world.wait_for_line(2, r"survived 1 failure", timeout=150)
        world.wait_for_line(3, r"survived 1 failure", timeout=60)
        world.kill(1, signal.SIGCONT)  # back after the others re-formed twice and finished
        result = world.wait(timeout=60)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [-signal.SIGKILL, 6, 0, 0], result.summary()
    for rank in (2, 3):
        output = result.output(rank)
        assert "process group of generation 1 (original ranks [1, 2, 3]) did not form" in output, output[-3000:]
        assert "meeting again as generation 2" in output, output[-3000:]
        assert (f"recovery 2: lost original rank(s) [0, 1]; new world of 2 (original ranks [2, 3], met at "
                f"127.0.0.1:{port + 2})") in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        [event] = recoveries(tmp_path, rank)
        assert (event["lost"], event["world"], event["generation"]) == ([0, 1], [2, 3], 2)
    stopped = result.output(1)
    assert ("original rank 1 was replaced: it hosts the store of generation 1 and stood still" in stopped
            and "it does not rejoin" in stopped), stopped[-3000:]
    assert "Traceback" not in stopped, stopped[-3000:]
    assert_exact(tmp_path, [2, 3])


def test_a_member_killed_as_the_new_generation_forms_the_others_meet_again(tmp_path: Path) -> None:
    # Original rank 1 dies as step 5 begins; original rank 2 registers in generation 1 and dies before its process
    # group forms. Original rank 0's store still answers: ranks 0 and 3 meet there again as generation 2.
    result = run(tmp_path, "1:5:KILL,2:reform:KILL", world_size=4)
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, -signal.SIGKILL, 0], result.summary()
    for rank in (0, 3):
        output = result.output(rank)
        assert "process group of generation 1 (original ranks [0, 2, 3]) did not form" in output, output[-3000:]
        assert "recovery 2: lost original rank(s) [1, 2]; new world of 2 (original ranks [0, 3]" in output, output[-3000:]
        assert "survived 1 failure(s)" in output.strip().splitlines()[-1], output[-3000:]
    assert_exact(tmp_path, [0, 3])
