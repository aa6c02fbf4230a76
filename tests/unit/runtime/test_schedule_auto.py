"""`--schedule auto`'s chooser (runtime/step/auto.py) on scripted stage times, and TrainConfig's side of it."""
from __future__ import annotations

import pytest

from model_parallel.errors import ConfigError, ScheduleError
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.optimizer.simulate import StageTimes
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.step.auto import Candidate, choose_schedule, chosen_schedule


def even(p: int, forward: float, backward: float) -> tuple[StageTimes, ...]:
    return (StageTimes(forward, backward),) * p


def test_equal_times_tie_goes_to_1f1b_which_holds_less() -> None:
    choice = choose_schedule([Candidate("gpipe", even(4, 10, 20)), Candidate("1f1b", even(4, 10, 20))], 4, 4)
    assert choice.name == "1f1b"
    assert [p.step_ms for p in choice.predictions] == [210.0, 210.0]  # (m + p - 1) (F + B)
    assert choice.line() == "schedule auto: chose 1f1b (predicted 210.0 ms/step, bubble 43 %; gpipe 210.0 ms)"


def test_interleaved_wins_where_its_smaller_bubble_outweighs_its_transfers() -> None:
    # The same model cut in 8 halves of the 4 stages' work, 2 per rank.
    candidates = [Candidate("1f1b", even(4, 10, 20), 0.5), Candidate("interleaved", even(8, 5, 10), 0.5)]
    choice = choose_schedule(candidates, 4, 4)
    assert choice.name == "interleaved"
    assert choice.chosen.bubble < choice.predictions[0].bubble
    assert choice.line().startswith("schedule auto: chose interleaved (predicted ")
    # A slow link: every one of interleaved's twice as many crossings pays it, and 1f1b wins.
    slow = [Candidate("1f1b", even(4, 10, 20), 20.0), Candidate("interleaved", even(8, 5, 10), 20.0)]
    assert choose_schedule(slow, 4, 4).name == "1f1b"


def test_gpipe_refused_by_memory_leaves_1f1b_and_the_line_says_why() -> None:
    candidates = [Candidate("gpipe", refused="no split of the model into 2 stages fits 1 GB per worker"),
                  Candidate("1f1b", even(2, 1, 2)),
                  Candidate("interleaved", refused="the interleaved schedule does not run --bf16")]
    choice = choose_schedule(candidates, 2, 2)
    assert choice.name == "1f1b"
    assert choice.line() == ("schedule auto: chose 1f1b (predicted 9.0 ms/step, bubble 33 %; gpipe refused: no split of "
                             "the model into 2 stages fits 1 GB per worker, interleaved refused: the interleaved "
                             "schedule does not run --bf16)")
    extra = choice.to_extra()
    assert (extra["name"], extra["chosen_by"], extra["predicted_step"]) == ("1f1b", "auto", 9.0)


def test_the_choice_does_not_depend_on_the_order_candidates_come_in() -> None:
    # Every rank builds the same candidates; the choice (and its line) must not depend on how they are listed.
    times = (StageTimes(1, 2), StageTimes(3, 1), StageTimes(2, 2))
    candidates = [Candidate("gpipe", times, 0.25), Candidate("1f1b", times, 0.25)]
    assert choose_schedule(candidates, 6, 3) == choose_schedule(candidates[::-1], 6, 3)
    assert [p.name for p in choose_schedule(candidates, 6, 3).predictions] == ["1f1b", "gpipe"]


def test_a_candidate_the_simulator_cannot_run_is_refused_not_fatal() -> None:
    # Interleaved over 4 ranks runs microbatches in rounds of 4: m = 2 cannot be built, so it is refused by name.
    choice = choose_schedule([Candidate("1f1b", even(4, 1, 2)), Candidate("interleaved", even(8, 0.5, 1))], 2, 4)
    assert choice.name == "1f1b"
    assert choice.refused == (("interleaved", "cannot be simulated: interleaved 1F1B runs microbatches in rounds of "
                                              "p=4: m=2 is not a multiple of p; use m=4"),)


def test_nothing_that_can_run_is_an_error_naming_every_reason() -> None:
    with pytest.raises(ScheduleError, match=r"no schedule can run this job \(1f1b: too big; gpipe: too big\)"):
        choose_schedule([Candidate("1f1b", refused="too big"), Candidate("gpipe", refused="too big")], 4, 4)
    with pytest.raises(ScheduleError, match=r"chooses among the flush schedules 1f1b, gpipe, interleaved, zbh1, zbinterleaved, zbv; got \['pipedream'\]"):
        choose_schedule([Candidate("pipedream", even(2, 1, 1))], 4, 2)


def test_the_choice_rides_on_the_plan_and_its_table_shows_the_bubble() -> None:
    choice = choose_schedule([Candidate("1f1b", even(2, 1, 2))], 2, 2)
    plan = Plan((StagePlan(0, ("a",), ranks=(0,)), StagePlan(1, ("b",), ranks=(1,))), extra={"schedule": choice.to_extra()})
    assert chosen_schedule(plan) == "1f1b"
    assert "schedule 1f1b (chosen by auto): predicted 9.0 ms per step, bubble 33 %" in plan.table()
    odd = Plan(plan.stages, extra={"schedule": {**choice.to_extra(), "predicted_step": "9"}})  # a hand-edited plan.json
    assert "chosen by" not in odd.table()  # not printed, and no crash
    assert chosen_schedule(Plan.from_dict(plan.to_dict())) == "1f1b"  # survives the broadcast's JSON
    with pytest.raises(ScheduleError, match=r"schedule 'auto' is resolved by the job builder"):
        chosen_schedule(Plan((StagePlan(0, ("a",), ranks=(0,)),)))


def test_train_config_takes_auto_and_resolves_it_from_the_plan() -> None:
    config = TrainConfig(schedule="auto", bf16=True, clip_grad=1.0)  # auto picks a flush schedule: clipping works
    assert config.schedule_refusals() == {}  # every schedule runs --bf16 and --recompute
    plan = Plan((StagePlan(0, ("a",), ranks=(0,)),), extra={"schedule": {"name": "gpipe"}})
    assert config.resolved(plan).schedule == "gpipe" and config.resolved(plan).schedule_auto
    from model_parallel.runtime.checkpoint.training_record import training_record

    # The checkpoint records "auto": a resume that chooses again (another world, new times) is no schedule change.
    assert training_record(config.resolved(plan), None, 0)["schedule"] == "auto"
    assert TrainConfig(schedule="1f1b").resolved(plan).schedule == "1f1b"
    with pytest.raises(ConfigError, match=r"schedule_auto marks a schedule auto chose, one of 1f1b, gpipe, interleaved"):
        TrainConfig(schedule="pipedream", schedule_auto=True)
    assert TrainConfig(schedule="zbinterleaved", recompute=True, bf16=True).recompute_stage(3)
    with pytest.raises(ConfigError, match=r"unknown schedule 'fast'; choose 1f1b, gpipe, pipedream, interleaved, zbh1, "
                                          r"zbinterleaved, zbv or auto"):
        TrainConfig(schedule="fast")
