"""ZB-H1's grid (runtime/step/zero_bubble.py) and the rules for split backwards (I, W) in schedule.check."""
from __future__ import annotations

import pytest

from model_parallel.errors import ScheduleError
from model_parallel.graph.in_flight import FLUSH_SCHEDULES, SCHEDULE_NAMES
from model_parallel.runtime.step.schedule import Action, check, format_grid, make_schedule, parse_grid

P3_M4 = """\
s0 0F0 0F1 0F2   .   . 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
s1   . 1F0 1F1   . 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
s2   .   . 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"""


def test_zbh1_is_registered_with_a_flush() -> None:
    assert "zbh1" in SCHEDULE_NAMES and "zbh1" in FLUSH_SCHEDULES
    assert make_schedule("zbh1", 3, 4).flush


def test_zbh1_grid_p3_m4() -> None:
    schedule = make_schedule("zbh1", 3, 4)
    assert schedule.grid == parse_grid(P3_M4).grid, format_grid(schedule)


@pytest.mark.parametrize("p, m", [(1, 1), (1, 3), (2, 1), (2, 2), (2, 4), (3, 2), (4, 4), (4, 8), (4, 5), (8, 16), (6, 7)])
def test_zbh1_passes_the_rules_with_1f1b_memory(p: int, m: int) -> None:
    schedule = make_schedule("zbh1", p, m)
    check(schedule)  # includes the in-flight bound: 1F1B's p - s (graph/in_flight.py)
    assert schedule.max_in_flight == make_schedule("1f1b", p, m).max_in_flight
    for s in range(p):
        kinds = [a.kind for a in schedule.stage_actions(s)]
        assert kinds.count("I") == kinds.count("W") == m and "B" not in kinds
        weights = [a.microbatch for a in schedule.stage_actions(s) if a.kind == "W"]
        assert weights == list(range(m))


def test_zbh1_defers_weights_into_the_drain() -> None:
    # On unit steps (F = I = W = 1) the grid is shorter than 1F1B's with B = I + W (2 units): 1F1B needs
    # (p-1)(F+B) + m(F+B) = 3*3 + 8*3 = 33 units at p = 4, m = 8; ZB-H1 27.
    schedule = make_schedule("zbh1", 4, 8)
    assert schedule.num_steps == 27
    last = schedule.stage_actions(3)
    assert [str(a) for a in last[-4:]] == ["3W4", "3W5", "3W6", "3W7"]  # the last stage holds back p-1 = 3 W's


def test_actions_parse_i_and_w() -> None:
    assert Action.parse("1I0") == Action(1, "I", 0) and str(Action(2, "W", 3)) == "2W3"
    with pytest.raises(ScheduleError, match="expected <stage><F|B|I|W><microbatch>"):
        Action.parse("1X0")


@pytest.mark.parametrize("grid, message", [
    ("s0 0F0 0W0 0I0", r"0W0 runs before its own input gradient \(0I0\)"),
    ("s0 0F0 . 0I0\ns1 . 1F0 .", r"0I0 runs before 1B0 or 1I0 \(the gradient from stage 1\)"),
    ("s0 0F0 0B0 0I0 0W0", r"the input gradient of stage 0, microbatch 0 runs twice"),
    ("s0 0F0 0I0", r"0B0 \(or 0W0\) never runs"),
    ("s0 0F0 0F1 0I0 0I1 0W1 0W0", r"0W1: stage 0 must run W of microbatch 0 next"),
])
def test_rules_for_split_backwards(grid: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        check(parse_grid(grid))


def test_a_stage_may_mix_whole_and_split_backwards() -> None:
    check(parse_grid("s0 0F0 0F1 0B0 0I1 0W1\n"))


def test_zbh1_round_trips_through_torch_csv(tmp_path) -> None:
    from model_parallel.runtime.step.schedule_csv import read_torch_csv, write_torch_csv

    schedule = make_schedule("zbh1", 4, 8)
    back = read_torch_csv(write_torch_csv(schedule, tmp_path / "zbh1.csv"))
    assert back.grid == schedule.grid


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (2, 3, 2), (8, 2, 16),
                                     (3, 2, 5)])
def test_zbinterleaved_passes_the_rules_on_loop_placement(p: int, v: int, m: int) -> None:
    from model_parallel.graph.in_flight import microbatches_in_flight
    from model_parallel.runtime.step.interleaved import interleaved_1f1b, run_schedule

    schedule = run_schedule("zbinterleaved", p * v, m, p)
    check(schedule)  # rank rows, each rank's in-flight bound (graph/in_flight.zero_bubble_in_flight)
    assert schedule.placement == tuple(tuple(c * p + r for c in range(v)) for r in range(p))
    for k in range(p * v):  # the optimizer's per-stage rule holds on the grid
        held = peak = 0
        for action in schedule.stage_actions(k):
            held += 1 if action.is_forward else -1 if action.sends_gradient else 0
            peak = max(peak, held)
        assert peak <= microbatches_in_flight("zbinterleaved", m, p * v, k)
    if m % p == 0:  # fewer idle unit steps than Interleaved 1F1B's (where B is one unit too)
        assert schedule.bubble_fraction < interleaved_1f1b(p, v, m).bubble_fraction


def test_zbinterleaved_refuses_one_stage_per_rank() -> None:
    from model_parallel.runtime.step.zero_bubble import zb_interleaved

    with pytest.raises(ScheduleError, match="needs p >= 2 ranks with v >= 2 stages each.*use zbh1"):
        zb_interleaved(4, 1, 8)


ZBV_P2_M4 = """\
s0 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
s1 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"""


def test_zbv_rows_p2_m4() -> None:
    """torch's ScheduleZBVZeroBubble order (p = 2: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2)."""
    from model_parallel.runtime.step.zero_bubble import zb_v

    schedule = zb_v(2, 4)
    assert schedule.placement == ((0, 3), (1, 2))
    want = parse_grid(ZBV_P2_M4)  # the rows as orders (parse_grid reads them as stage rows: compare actions only)
    assert [list(map(str, schedule.row_actions(r))) for r in range(2)] == \
        [[str(a) for a in row if a is not None] for row in want.grid]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 3])
def test_zbv_passes_the_rules_with_its_bounds(p: int, m_per_p: int) -> None:
    from model_parallel.graph.in_flight import microbatches_in_flight
    from model_parallel.runtime.step.interleaved import run_schedule

    m = m_per_p * p
    schedule = run_schedule("zbv", 2 * p, m, p)
    check(schedule)  # each rank's bound: 2p pairs (graph/in_flight.zbv_in_flight)
    for k in range(2 * p):  # the optimizer's per-stage rule (1F1B's over the 2p stages) holds on the grid
        held = peak = 0
        for action in schedule.stage_actions(k):
            held += 1 if action.is_forward else -1 if action.sends_gradient else 0
            peak = max(peak, held)
        assert peak <= microbatches_in_flight("zbv", m, 2 * p, k)


def test_zbv_refusals_name_the_fix() -> None:
    from model_parallel.runtime.step.interleaved import run_schedule
    from model_parallel.runtime.step.zero_bubble import zb_v

    with pytest.raises(ScheduleError, match="give --num_stages 8"):
        run_schedule("zbv", 12, 8, 4)
    with pytest.raises(ScheduleError, match="needs p >= 2 ranks"):
        zb_v(1, 4)


def _torch_order(cls_name: str, p: int, stage_ids: list[int], m: int) -> dict:
    """A torch zero-bubble schedule's pipeline order for every rank (its IR; stand-in stages, no process group)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=2 * p if cls_name == "ScheduleZBVZeroBubble"
                              else len(stage_ids) * p, stage_index=k, is_first=k == 0, is_last=False,
                              submod=None)
              for k in stage_ids]
    return getattr(schedules, cls_name)(stages, m, loss_fn=None).pipeline_order


@pytest.mark.parametrize("p,v,m", [(2, 1, 2), (4, 1, 8), (3, 1, 5), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_zero_bubble_orders_equal_torchs_interleaved_zero_bubble(p: int, v: int, m: int) -> None:
    from model_parallel.runtime.step.zero_bubble import zero_bubble_orders

    order = _torch_order("ScheduleInterleavedZeroBubble", p, [c * p for c in range(v)], m)
    ours = zero_bubble_orders(p, v, m)
    for rank in range(p):
        assert [str(a) for a in order[rank] if a is not None] == [str(a) for a in ours[rank]]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8)])
def test_zbv_orders_equal_torchs(p: int, m: int) -> None:
    from model_parallel.runtime.step.zero_bubble import zbv_orders

    order = _torch_order("ScheduleZBVZeroBubble", p, [0, 2 * p - 1], m)
    ours = zbv_orders(p, m)
    for rank in range(p):
        assert [str(a) for a in order[rank] if a is not None] == [str(a) for a in ours[rank]]
