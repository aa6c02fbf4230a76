"""graph/in_flight.py: the schedules' names and microbatches in flight, one rule for the grids and the memory model."""
import pytest

from model_parallel.graph.in_flight import SCHEDULE_NAMES, microbatches_in_flight
from model_parallel.optimizer.memory import Footprint, in_flight
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.step.schedule import MULTI_STAGE, SCHEDULES, make_schedule


def peak_in_flight(schedule, stage):
    """The most microbatches `stage` has forwarded and not yet backwarded, read off the grid."""
    held = peak = 0
    for action in schedule.grid[stage]:
        if action is not None:
            held += 1 if action.is_forward else -1
            peak = max(peak, held)
    return peak


def test_literal_values():
    # 4 ranks, 8 microbatches, one replica per stage: stage s holds 4 - s under 1F1B and PipeDream, all 8 under GPipe.
    assert [microbatches_in_flight("1f1b", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight("pipedream", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight("gpipe", 8, 4, s) for s in range(4)] == [8, 8, 8, 8]
    assert microbatches_in_flight("1f1b", 2, 4, 0) == 2  # m caps a flush schedule
    assert microbatches_in_flight("pipedream", 2, 4, 0) == 4  # no flush: the stream never drains
    assert microbatches_in_flight("1f1b", 8, 6, 0, replicas=2) == 3  # replicas share the microbatches round-robin
    assert microbatches_in_flight("gpipe", 5, 6, 0, replicas=2) == 3


def test_unknown_schedule_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown schedule 'zb'; choose one of 1f1b, gpipe, pipedream"):
        microbatches_in_flight("zb", 4, 2, 0)


@pytest.mark.parametrize("name", tuple(SCHEDULES))  # one stage per rank (interleaved: below)
@pytest.mark.parametrize("p, m", [(1, 1), (2, 4), (3, 3), (4, 6), (4, 9)])
def test_the_grids_hold_what_the_rule_says(name, p, m):
    schedule = make_schedule(name, p, m)
    expected = [microbatches_in_flight(name, m, p, s) for s in range(p)]
    assert list(schedule.max_in_flight) == expected
    assert [peak_in_flight(schedule, s) for s in range(p)] == expected  # the bound is reached, never passed


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_memory_model_counts_with_the_same_rule(name):
    for ranks_before in range(4):
        assert in_flight(Footprint(schedule=name, microbatches=6), 4, ranks_before, 1) == \
            microbatches_in_flight(name, 6, 4, ranks_before)


def test_interleaved_rule_bounds_every_stage_of_the_grid():
    from model_parallel.runtime.step.interleaved import interleaved_1f1b

    for p in range(1, 6):
        for v in range(1, 5):
            for m in range(p, 3 * p + 1, p):
                schedule, stages = interleaved_1f1b(p, v, m), p * v
                for k in range(stages):
                    held = peak = 0
                    for action in schedule.stage_actions(k):
                        held += 1 if action.is_forward else -1
                        peak = max(peak, held)
                    assert peak <= microbatches_in_flight("interleaved", m, stages, k), (p, v, m, k)
    assert [microbatches_in_flight("interleaved", 8, 8, k) for k in range(8)] == [8, 8, 8, 8, 8, 6, 4, 2]


def test_every_owner_names_the_same_schedules():
    assert set(SCHEDULES) | set(MULTI_STAGE) | {"zbh1"} == set(SCHEDULE_NAMES)  # zbh1: zero_bubble.py
    assert TrainConfig().schedule == SCHEDULE_NAMES[0]
    for name in SCHEDULE_NAMES:
        TrainConfig(schedule=name)
        Footprint(schedule=name)
