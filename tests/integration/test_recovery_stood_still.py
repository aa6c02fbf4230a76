"""`--recover`: a worker stopped (SIGSTOP) as it began recovering from a peer's loss, continued after the others had
recovered without it and finished. Their store is gone with them, which it read as its host lost: it formed a world
of its own, said "recovery 1: lost original rank(s) [0, 1]" of ranks that had finished, and exited 0 (had the job
still run elsewhere, it would have trained alone into the job's checkpoint directory). It knows it stood still:
it exits 6, replaced, as the documented promise for a continued process says (runtime/wire/recovery._meeting_store)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from model_parallel.runtime.launch import LocalWorld, worker_commands
from support.recovery import args, assert_exact

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_a_worker_stopped_as_it_began_recovering_is_replaced_when_continued(tmp_path: Path) -> None:
    commands = worker_commands(args(tmp_path / "ck", tmp_path), 3)
    with LocalWorld(commands, env={"MP_TEST_SIGNAL_AT_STEP": "1:5:KILL,2:recovery:STOP"}) as world:
        world.procs[0].wait(timeout=150)  # rank 0 recovered without ranks 1 and 2, finished, and took its store along
        world.kill(2, signal.SIGCONT)
        result = world.wait(timeout=60)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 6], result.summary()
    assert "recovery 1: lost original rank(s) [1, 2]; new world of 1 (original ranks [0]" in result.output(0)
    output = result.output(2)
    assert ("original rank 2 was replaced: it stood still for" in output and "it does not rejoin" in output
            and "survived" not in output and "Traceback" not in output), output[-3000:]
    assert_exact(tmp_path, [0])
