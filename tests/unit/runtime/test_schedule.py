"""Schedules as data: text round trips, literal grids, rule checks (exhaustive over small p, m)."""
from __future__ import annotations

import pytest

from model_parallel.errors import ScheduleError
from model_parallel.runtime.step.schedule import (
    Action,
    Schedule,
    check,
    format_grid,
    gpipe,
    make_schedule,
    one_f_one_b,
    parse_grid,
    pipedream_async,
    weight_version,
)

SMALL = [(p, m) for p in range(1, 6) for m in range(1, 9)]


def test_action_text_round_trip():
    action = Action.parse("2F0")
    assert action == Action(2, "F", 0)
    assert str(action) == "2F0"
    assert str(Action.parse("13B7")) == "13B7"
    with pytest.raises(ScheduleError, match=r"cannot parse action '2X0'"):
        Action.parse("2X0")
    with pytest.raises(ScheduleError, match="kind must be one of F, B, I, W, got 'Q'"):
        Action(0, "Q", 0)


def test_one_f_one_b_literal_grid():
    grid = format_grid(one_f_one_b(3, 4)).splitlines()
    assert grid[2].split() == ["s0", "0F0", "0F1", "0F2", ".", ".", "0B0", "0F3", "0B1", ".", "0B2", ".", "0B3"]
    assert grid[3].split() == ["s1", ".", "1F0", "1F1", ".", "1B0", "1F2", "1B1", "1F3", "1B2", ".", "1B3", "."]
    assert grid[4].split() == ["s2", ".", ".", "2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3", ".", "."]


def test_gpipe_literal_grid():
    schedule = gpipe(2, 2)
    assert [list(map(str, schedule.stage_actions(s))) for s in range(2)] == [
        ["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    assert schedule.num_steps == 6  # (m + p - 1) forward steps + (m + p - 1) backward steps


@pytest.mark.parametrize("p,m", SMALL)
def test_generated_schedules_pass_the_rules(p, m):
    for factory in (gpipe, one_f_one_b, pipedream_async):
        schedule = factory(p, m)
        check(schedule)
        # text round trip of the whole grid
        assert parse_grid(format_grid(schedule)).grid == schedule.grid
        # every stage holds each microbatch's F and B once
        for s in range(p):
            assert sorted(map(str, schedule.stage_actions(s))) == sorted(
                [f"{s}F{j}" for j in range(m)] + [f"{s}B{j}" for j in range(m)])


@pytest.mark.parametrize("p,m", SMALL)
def test_1f1b_in_flight_bound_and_length(p, m):
    schedule = one_f_one_b(p, m)
    for s in range(p):
        in_flight = peak = 0
        for action in schedule.stage_actions(s):
            in_flight += 1 if action.is_forward else -1
            peak = max(peak, in_flight)
        assert peak == min(p - s, m)
    # 1F1B takes as many unit steps as GPipe: 2 (m + p - 1)
    assert schedule.num_steps == gpipe(p, m).num_steps == 2 * (m + p - 1)


@pytest.mark.parametrize("p,m", [(2, 3), (3, 4), (4, 8)])
def test_replica_subsequences_keep_order(p, m):
    schedule = one_f_one_b(p, m)
    for replicas in (1, 2, 3):
        covered = []
        for i in range(replicas):
            actions = schedule.rank_actions(1 % p, i, replicas)
            assert all(a.microbatch % replicas == i for a in actions)
            covered += actions
        assert sorted(covered) == sorted(schedule.stage_actions(1 % p))


def test_check_reports_backward_before_gradient_arrives():
    good = one_f_one_b(2, 2)
    rows = [list(r) for r in good.grid]
    # stage 0 runs 0B0 before stage 1's 1B0: swap it into step 2 (where stage 0 idles)
    t_b = rows[0].index(Action(0, "B", 0))
    rows[0][t_b], rows[0][2] = None, Action(0, "B", 0)
    bad = Schedule("broken", 2, 2, tuple(map(tuple, rows)))
    with pytest.raises(ScheduleError, match=r"step 2: 0B0 runs before 1B0 or 1I0 \(the gradient from stage 1\)"):
        check(bad)


def test_check_reports_missing_duplicate_and_order():
    with pytest.raises(ScheduleError, match=r"0B1 \(or 0I1\) never runs"):
        check(parse_grid("s0 0F0 0F1 0B0"))
    with pytest.raises(ScheduleError, match=r"step 1: 0F0 runs twice"):
        check(parse_grid("s0 0F0 0F0 0B0"))
    with pytest.raises(ScheduleError, match=r"step 0: 0F1: stage 0 must run F of microbatch 0 next"):
        check(parse_grid("s0 0F1 0F0 0B0 0B1"))
    with pytest.raises(ScheduleError, match=r"step 0: 0B0 runs before its own forward"):
        check(parse_grid("s0 0B0 0F0"))
    with pytest.raises(ScheduleError, match=r"1F0 is on stage 0's row"):
        check(parse_grid("s0 1F0\ns1 ."))


def test_check_enforces_1f1b_bound():
    grid = gpipe(2, 3).grid
    bounded = Schedule("1f1b", 2, 3, grid, max_in_flight=(2, 1))
    with pytest.raises(ScheduleError, match=r"stage 0 holds 3 microbatches in flight, above the 1F1B bound 2"):
        check(bounded)


def test_check_marks_the_failing_step():
    with pytest.raises(ScheduleError) as info:
        check(parse_grid("s0 0F0 .   0B0\ns1 .   1B0 1F0"))
    text = str(info.value)
    assert "step 1: 1B0 runs before its own forward" in text
    assert text.rstrip().endswith("^")


def test_pipedream_weight_versions():
    schedule = pipedream_async(3, 6)
    assert not schedule.flush
    # stage s runs forward j on version max(0, j - (p-1-s)): staleness p-1-s
    for s in range(3):
        for j in range(6):
            assert weight_version(schedule, s, j) == max(0, j - (3 - 1 - s))
    assert weight_version(one_f_one_b(3, 6), 0, 5) == 0


def test_make_schedule_and_sizes():
    assert make_schedule("gpipe", 2, 2).name == "gpipe"
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zb'; choose one of"):
        make_schedule("zb", 2, 2)
    with pytest.raises(ScheduleError, match="at least 1 microbatch"):
        one_f_one_b(2, 0)
    with pytest.raises(ScheduleError, match="no grid rows"):
        parse_grid("nothing here")
