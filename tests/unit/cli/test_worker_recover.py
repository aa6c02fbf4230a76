"""cli/worker_recover.py without processes: what --recover refuses up front, and the recovery record's forms."""
from __future__ import annotations

import pytest

from model_parallel.cli import worker
from model_parallel.cli.worker_recover import RecoveryRecord
from model_parallel.errors import ConfigError

RECOVER = ["--model", "mlp", "--recover"]
WORLD = ["--rank", "0", "--world_size", "2"]


@pytest.mark.parametrize("argv, message", [
    (["--rank", "0", "--checkpoint_dir", "ck", "--recover"],
     "--recover with a job the coordinator serves (no --model/--package/--graph): a re-formed world rebuilds its job "
     "from the command line"),
    (WORLD, "--recover needs --checkpoint_dir"),
    ([*WORLD, "--checkpoint_dir", "ck", "--single_process"], "--recover with --single_process"),
    (["--checkpoint_dir", "ck"], "--recover needs a world joined with --rank/--world_size/--dist_addr: under torchrun its "
                                 "agent restarts every worker"),  # no --rank: torchrun's $RANK
])
def test_recover_refuses_what_it_cannot_do_before_joining(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        worker.main([*RECOVER, *argv] if "--recover" not in argv else argv)  # raised before any world is joined: cli.common makes it exit 2


def test_the_record_round_trips_through_its_metrics_line() -> None:
    record = RecoveryRecord(me=2, generation=1, lost=(1,), world=(0, 2), store="127.0.0.1:29501", checkpoint_dir="ck",
                            checkpoint_step=3, done_before=5, continued_at=4, seconds=0.75)
    data = record.to_json()
    assert data["event"] == "recovery" and data["recomputed"] == 1
    assert RecoveryRecord.from_json(data) == record
    assert record.line() == ("[original rank 2] recovery 1: lost original rank(s) [1]; new world of 2 (original ranks "
                             "[0, 2], met at 127.0.0.1:29501); restored checkpoint step 3 from ck; recomputed 1 step(s) "
                             "(continued at step 4); 0.75 s from detection to the first completed step")
    with pytest.raises(ValueError, match=r"a recovery record lacks \['seconds'\]"):
        RecoveryRecord.from_json({k: v for k, v in data.items() if k != "seconds"})


def test_a_step_completed_before_its_checkpoint_commit_failed_counts_as_done() -> None:
    # QA: a peer killed while step 5's checkpoint was committed (checkpoint step 3 the latest): steps 4 and 5 both
    # ran again, but the line said "recomputed 1 step(s)": the loop counts a step in next_step only after its commit.
    from types import SimpleNamespace

    from model_parallel.cli.worker_recover import steps_done
    from model_parallel.runtime.checkpoint.live import StepTracker

    engine, tracker = SimpleNamespace(next_step=5), StepTracker()
    tracker.done = 5  # the step's update ran (its metrics line was written), then save_checkpoint(5) failed
    assert steps_done(engine, tracker) == 6
    tracker.in_step, tracker.done = 5, 4  # killed inside step 5: step 4 was the last completed
    assert steps_done(engine, tracker) == 5
    assert steps_done(engine, None) == 5 and steps_done(None, tracker) == 0
