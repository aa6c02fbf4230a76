"""graph/in_flight.py: the schedules' names and microbatches in flight, one rule for the grids and the memory model."""
import pytest

from model_parallel.graph.in_flight import (SCHEDULE_NAMES, activations_held, microbatches_in_flight,
                                            zero_bubble_pairs_held)
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
            activations_held(name, 6, 4, ranks_before)
        if name != "zbh1":  # the one schedule whose memory outlives its in-flight bound (below)
            assert activations_held(name, 6, 4, ranks_before) == microbatches_in_flight(name, 6, 4, ranks_before)


def held_until_w(order):
    """Per stage and in all, the most microbatches a rank's order has forwarded and not yet through their W (or B):
    our I keeps a microbatch's autograd graph for its W, so its activations live that long."""
    held, stage_peak, total, peak = {}, {}, 0, 0
    for action in order:
        step = 1 if action.kind == "F" else -1 if action.kind in ("B", "W") else 0
        held[action.stage] = held.get(action.stage, 0) + step
        total += step
        stage_peak[action.stage] = max(stage_peak.get(action.stage, 0), held[action.stage])
        peak = max(peak, total)
    return stage_peak, peak


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_zbh1_holds_p_microbatches_on_every_stage_until_their_w(p):
    from model_parallel.runtime.step.zero_bubble import zero_bubble_orders

    for m in (p, p + 1, 2 * p, 3 * p):
        walked = [held_until_w(order)[0][r] for r, order in enumerate(zero_bubble_orders(p, 1, m))]
        assert walked == [activations_held("zbh1", m, p, s) for s in range(p)] == [min(p, m)] * p, (p, m)
        # ... while the schedule's own bound (until I, what `check` enforces) is 1F1B's p - s.
        assert [microbatches_in_flight("zbh1", m, p, s) for s in range(p)] == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("v", [2, 3])
def test_zbinterleaved_ranks_hold_rank_0s_count_until_their_w(p, v):
    from model_parallel.runtime.step.zero_bubble import zero_bubble_orders

    for m in (p, p + 1, 2 * p, 3 * p):
        walked = [held_until_w(order)[1] for order in zero_bubble_orders(p, v, m)]
        assert walked == [zero_bubble_pairs_held(m, p, v)] * p, (p, v, m)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zbv_stages_hold_their_in_flight_bound_until_their_w(p):
    from model_parallel.runtime.step.zero_bubble import zbv_orders

    for m in (p, 2 * p, 3 * p):
        walked = {}
        for order in zbv_orders(p, m):
            walked.update(held_until_w(order)[0])
        assert [walked[k] for k in range(2 * p)] == [activations_held("zbv", m, 2 * p, k) for k in range(2 * p)]


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
