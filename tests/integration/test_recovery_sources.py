"""`--recover` restores the lost rank's stage from the best source there is (cli/recover_sources.py): a live
replica of it on a survivor loses no step (only the one in progress is redone); without one, the latest committed
checkpoint, and the recovery line says why. Every run ends with the parameters and per-step losses of
uninterrupted single-process training (the oracle of every pipeline run of the mlp). Ranks are signalled by the
test hook `MP_TEST_SIGNAL_AT_STEP` as their step begins, so each failure happens at a known step."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from support.recovery import assert_exact, recoveries, run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
REPLICATED = ("--num_stages", "2", "--stage_to_num_ranks", "0:2,1:1")  # stage 0 on ranks 0 and 1, stage 1 on rank 2


def test_a_live_replica_of_the_lost_stage_loses_no_step(tmp_path: Path) -> None:
    # Checkpoints every 4 steps: step 3 is committed, steps 4 and 5 are done when rank 1 (stage 0's second replica)
    # dies as step 6 begins. From the checkpoint 2 steps would be redone; from the replica on rank 0, none.
    result = run(tmp_path, "1:6:KILL", every=4, extra=REPLICATED)
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0], result.summary()
    for rank in (0, 2):
        output = result.output(rank)
        assert ("recovery 1: lost original rank(s) [1]; new world of 2 (original ranks [0, 2]" in output
                and f"restored step 5 from the replica of stage 0 on original rank 0 (committed as checkpoint step 5 in "
                    f"{tmp_path / 'ck'}); recomputed 0 step(s) (continued at step 6)" in output), output[-3000:]
        assert "no live copy" not in output and "Traceback" not in output, output[-3000:]
        [event] = recoveries(tmp_path, rank)
        assert (event["source_kind"], event["checkpoint_step"], event["recomputed"]) == ("replica", 5, 0), event
    assert_exact(tmp_path, [0, 2])


def test_an_unreplicated_stage_comes_back_from_the_checkpoint_and_the_line_says_why(tmp_path: Path) -> None:
    result = run(tmp_path, "2:6:KILL", every=4, extra=REPLICATED)  # rank 2 held stage 1 alone
    assert [w.returncode for w in result.workers] == [0, 0, -signal.SIGKILL], result.summary()
    for rank in (0, 1):
        output = result.output(rank)
        assert (f"restored checkpoint step 3 from {tmp_path / 'ck'}; recomputed 2 step(s) (continued at step 4)" in output
                and "no live copy: stage(s) [1] had no copy outside the lost original rank(s) [2] (no replica)" in output), output[-3000:]
        [event] = recoveries(tmp_path, rank)
        assert (event["source_kind"], event["checkpoint_step"], event["recomputed"]) == ("checkpoint", 3, 2), event
    assert_exact(tmp_path, [0, 1])
