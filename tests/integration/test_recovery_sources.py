"""`--recover` restores the lost rank's stage from the best source there is (cli/recover_sources.py): a live
replica of it on a survivor, or under `--redundancy 1` the copy its buddy keeps, loses no step (only the one in
progress is redone); without either, the latest committed checkpoint, and the recovery line says why. Every run ends with the parameters and per-step losses of
uninterrupted single-process training (the oracle of every pipeline run of the mlp). Ranks are signalled by the
test hook `MP_TEST_SIGNAL_AT_STEP` as their step begins, so each failure happens at a known step."""
from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from model_parallel.runtime.launch import launch_workers
from support.recovery import args, assert_exact, recoveries, run

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
                and "no live copy: stage(s) [1] had no state of step 5 outside the lost original rank(s) [2] (no replica, "
                    "no --redundancy copy)" in output), output[-3000:]
        [event] = recoveries(tmp_path, rank)
        assert (event["source_kind"], event["checkpoint_step"], event["recomputed"]) == ("checkpoint", 3, 2), event
    assert_exact(tmp_path, [0, 1])


@pytest.mark.parametrize("killed", [1, 0], ids=["a_worker", "rank0_the_store_host"])
def test_a_redundancy_copy_of_the_lost_stage_loses_no_step(tmp_path: Path, killed: int) -> None:
    # 3 stages, one per rank; each rank's buddy is the next: original rank 1's state lives on rank 2, rank 0's on
    # rank 1. The hook signals once the buddy acknowledged the snapshot of step 5 (cli/worker_recover.py).
    result = run(tmp_path, f"{killed}:6:KILL", every=4, extra=("--redundancy", "1"))
    survivors = [r for r in range(3) if r != killed]
    assert [w.returncode for w in result.workers] == [-signal.SIGKILL if r == killed else 0 for r in range(3)], result.summary()
    buddy = killed + 1
    for rank in survivors:
        output = result.output(rank)
        assert (f"restored step 5 from the redundancy copy of original rank {killed}'s stage {killed} on original rank "
                f"{buddy} (committed as checkpoint step 5 in {tmp_path / 'ck'}); recomputed 0 step(s) (continued at "
                f"step 6)" in output), output[-3000:]
        assert f"--redundancy 1 (every 1 step(s)): its own snapshots 2 x " in output, output[-3000:]
        assert re.search(r"--redundancy 1 memory \(plan v0\): its own snapshots 2 x 0\.\d\d MB \+ a copy of original "
                         rf"rank {(rank - 1) % 3}'s stage 0\.\d\d MB", output), output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        [event] = recoveries(tmp_path, rank)
        assert (event["source_kind"], event["checkpoint_step"], event["recomputed"]) == ("redundancy", 5, 0), event
    assert f"--redundancy 1: keeps original rank {killed}'s stage state, " in result.output(buddy)
    assert_exact(tmp_path, survivors)


def test_redundancy_without_recover_is_refused(tmp_path: Path) -> None:
    argv = [a for a in args(tmp_path / "ck", tmp_path) if a != "--recover"] + ["--redundancy", "1"]
    result = launch_workers(argv, 2, timeout=60)
    assert [w.returncode for w in result.workers] == [2, 2], result.summary()
    assert "--redundancy 1 needs --recover" in result.output(0), result.output(0)[-2000:]


def test_redundancy_copies_serve_a_second_failure_in_the_re_formed_world(tmp_path: Path) -> None:
    # After the first recovery (3 -> 2 workers) the copies run again in the new world: original rank 2's buddy is
    # now rank 0, so when rank 2 dies as step 7 begins, rank 0 holds its state of step 6.
    result = run(tmp_path, "1:5:KILL,2:7:KILL", every=4, extra=("--redundancy", "1"))
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, -signal.SIGKILL], result.summary()
    output = result.output(0)
    assert "recovery 1: lost original rank(s) [1]; new world of 2" in output, output[-3000:]
    assert ("restored step 6 from the redundancy copy of original rank 2's stage 1 on original rank 0 (committed as "
            "checkpoint step 6" in output), output[-3000:]
    assert "survived 2 failure(s)" in output.strip().splitlines()[-1], output[-3000:]
    assert [(e["source_kind"], e["checkpoint_step"], e["recomputed"]) for e in recoveries(tmp_path, 0)] == [
        ("redundancy", 4, 0), ("redundancy", 6, 0)]
    assert_exact(tmp_path, [0])


def test_a_rank_and_its_buddy_lost_together_without_a_checkpoint_end_with_exit_3(tmp_path: Path) -> None:
    # Original rank 1 dies as step 2 begins, rank 2 (which holds rank 1's copy) as its recovery begins; no checkpoint
    # is committed yet (every 5 steps). Rank 0 still holds rank 2's copy (stage 2), but nothing of stage 1 is left.
    result = run(tmp_path, "1:2:KILL,2:recovery:KILL", every=5, extra=("--redundancy", "1"))
    assert [w.returncode for w in result.workers] == [3, -signal.SIGKILL, -signal.SIGKILL], result.summary()
    output = result.output(0)
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "rank 1 stopped responding" in errors[0], output[-3000:]
    assert (f"cannot recover: no committed checkpoint in {tmp_path / 'ck'} to restore the stage of original rank(s) "
            "[1, 2] from, and no live copy (stage(s) [1] had no state of step 1 outside the lost original rank(s) "
            "[1, 2] (no replica, no --redundancy copy))") in errors[0], output[-3000:]
    assert f"no checkpoint was committed in {tmp_path / 'ck'}; rerun to start over:" in output.strip().splitlines()[-1]
