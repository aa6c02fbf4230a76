"""cli/recover_schedule.py: the schedule a re-formed world runs, and what its checkpoints record of it."""
from __future__ import annotations

import argparse
import logging

import pytest

from model_parallel.cli.recover_schedule import fit_schedule, stand_in
from model_parallel.cli.worker import build_parser
from model_parallel.runtime.checkpoint.training_record import check_resume, training_record
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.batches import SyntheticData


@pytest.mark.parametrize("schedule, world, m, runs", [
    ("interleaved", 3, 8, "1f1b"), ("interleaved", 4, 8, "interleaved"), ("interleaved", 1, 8, "1f1b"),
    # zero bubble's rounds: m in equal rounds of about the world size (m=4 on 3 ranks: one round), not m % world
    ("zbinterleaved", 3, 4, "zbinterleaved"), ("zbinterleaved", 4, 9, "zbh1"), ("zbv", 3, 4, "zbv"),
    ("zbv", 2, 4, "zbv"), ("zbv", 1, 4, "zbh1"),
    ("1f1b", 3, 8, "1f1b"), ("zbh1", 3, 4, "zbh1"), ("auto", 3, 8, "auto"),  # auto: the job builder chooses again
])
def test_the_asked_schedule_where_it_fits_else_its_one_stage_per_rank_stand_in(schedule: str, world: int, m: int,
                                                                                runs: str) -> None:
    got, why = stand_in(schedule, world, m)
    assert got == runs and (why is None) == (runs == schedule)


def test_the_line_names_the_rule_the_world_and_what_runs_instead() -> None:
    assert stand_in("interleaved", 3, 8)[1] == ("schedule interleaved cannot run on this world of 3 (interleaved 1F1B runs "
                                                "microbatches in rounds of p=3: m=8 is not a multiple of p): this world runs 1f1b")
    assert stand_in("zbv", 1, 4)[1] == ("schedule zbv cannot run on this world of 1 (the zbv schedule places several stages "
                                        "on each of >= 2 ranks; this world has 1): this world runs zbh1")


def test_the_checkpoint_records_the_asked_schedule_and_a_world_that_grows_back_runs_it_again(
        caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser().parse_args(["--model", "mlp", "--schedule", "interleaved", "--num_microbatches", "8"])
    config = TrainConfig(batch_size=8, num_microbatches=8, schedule="interleaved")
    data = SyntheticData(8, (4,))
    with caplog.at_level(logging.WARNING):
        small_args, small = fit_schedule(args, config, 3, 0)
    assert (small_args.schedule, small.schedule, small.schedule_asked) == ("1f1b", "1f1b", "interleaved")
    assert args.schedule == "interleaved"  # the flags the next world starts from are untouched
    assert [r.getMessage() for r in caplog.records] == [
        "[rank 0] schedule interleaved cannot run on this world of 3 (interleaved 1F1B runs microbatches in rounds of "
        "p=3: m=8 is not a multiple of p): this world runs 1f1b"]
    record = training_record(small, data, 4)
    assert (record["schedule"], record["schedule_running"]) == ("interleaved", "1f1b")
    # A resume with the run's own flags (--schedule interleaved) is no schedule change.
    assert check_resume(record, training_record(config, data, 4), allow=False, where="ck") == []
    # Grown back to 4 (an admission), from the stand-in's config: interleaved again, nothing logged.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        big_args, big = fit_schedule(small_args, small, 4, 0)
    assert (big_args.schedule, big.schedule, big.schedule_asked) == ("interleaved", "interleaved", None)
    assert caplog.records == []


def test_an_admission_under_a_coordinator_keeps_the_schedule_that_ran_the_kept_plan() -> None:
    from model_parallel.cli.recover_coordinator import Recovered
    from model_parallel.graph.plan import Plan, StagePlan

    def plan(ranks: tuple[int, ...]) -> Plan:
        return Plan(stages=tuple(StagePlan(k, (f"n{k}",), 1, (r,)) for k, r in enumerate(ranks)))

    args = build_parser().parse_args(["--model", "mlp", "--schedule", "interleaved", "--num_microbatches", "4"])
    config = TrainConfig(batch_size=8, num_microbatches=4, schedule="interleaved")
    for placement, runs in (((0, 1, 0, 1), "interleaved"), ((0, 1), "1f1b")):  # a loop on 2 ranks; one stage each
        kept = Recovered(2, (0, 1, 2), (), 5, 3, (2,), plan(placement))
        fitted, fitted_config = fit_schedule(argparse.Namespace(**{**vars(args), "recovered": kept}), config, 3, 0)
        assert (fitted.schedule, fitted_config.schedule) == (runs, runs), placement
