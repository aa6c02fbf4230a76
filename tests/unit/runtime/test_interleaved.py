"""runtime/step/interleaved.py: Interleaved 1F1B as rank rows over several stages, checked by the rules."""
from __future__ import annotations

import pytest

from model_parallel.errors import ScheduleError
from model_parallel.graph.in_flight import interleaved_in_flight, interleaved_warmup
from model_parallel.runtime.step.interleaved import analytic_bubble, interleaved_1f1b, interleaved_orders, loop_placement
from model_parallel.runtime.step.schedule import Action, Schedule, check, format_grid, one_f_one_b
from model_parallel.runtime.step.schedule_csv import parse_torch_csv, torch_csv_text

# (ranks, stages per rank, microbatches): m a multiple of p
SIZES = [(p, v, m) for p in range(1, 6) for v in range(1, 4) for m in range(p, 3 * p + 1, p)]


def test_loop_placement():
    assert loop_placement(4, 2) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert loop_placement(2, 3) == ((0, 2, 4), (1, 3, 5))


def test_literal_grid():
    lines = format_grid(interleaved_1f1b(2, 2, 2)).splitlines()
    assert lines[0] == "interleaved p=4 ranks=2 m=2"
    assert lines[2].split() == ["r0", "0F0", "0F1", "2F0", "2F1", ".", "2B0", ".", "2B1", "0B0", "0B1"]
    assert lines[3].split() == ["r1", ".", "1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1", "."]


def test_megatron_order_rounds_of_p():
    # rank 0 of p=2, v=2, m=4: forwards go through local stage 0 then 1 in rounds of p microbatches.
    forwards = [str(a) for a in interleaved_orders(2, 2, 4)[0] if a.is_forward]
    assert forwards == ["0F0", "0F1", "2F0", "2F1", "0F2", "0F3", "2F2", "2F3"]
    assert interleaved_warmup(4, 2, 2, 0) == 4 and interleaved_warmup(4, 2, 2, 1) == 2


@pytest.mark.parametrize("p,v,m", SIZES)
def test_generated_grids_pass_the_rules_and_meet_the_analytic_bubble(p, v, m):
    schedule = interleaved_1f1b(p, v, m)
    check(schedule)
    assert schedule.num_rows == p and schedule.num_stages == p * v
    assert schedule.bubble_fraction == pytest.approx(analytic_bubble(p, v, m))
    for stage in range(p * v):
        assert schedule.row_of(stage) == stage % p
        forwards = [a.microbatch for a in schedule.stage_actions(stage) if a.is_forward]
        backwards = [a.microbatch for a in schedule.stage_actions(stage) if not a.is_forward]
        assert forwards == list(range(m)) and backwards == list(range(m))
    # the peak a rank holds is exactly the in-flight rule the memory model will count with
    for r in range(p):
        held = peak = 0
        for action in schedule.row_actions(r):
            held += 1 if action.is_forward else -1
            peak = max(peak, held)
        assert peak == interleaved_in_flight(m, p, v, r)


def test_bubble_beats_one_f_one_b():
    # the numbers at p=4, m=4: 1F1B 43 %, interleaved with 2 stages per rank 27 %
    assert one_f_one_b(4, 4).bubble_fraction == pytest.approx(3 / 7)
    assert interleaved_1f1b(4, 2, 4).bubble_fraction == pytest.approx(3 / 11)
    assert analytic_bubble(4, 1, 4) == pytest.approx(one_f_one_b(4, 4).bubble_fraction)


def test_m_not_a_multiple_of_p_is_refused_with_the_fix():
    with pytest.raises(ScheduleError, match=r"m=6 is not a multiple of p; use m=8 \(or 4\)"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ScheduleError, match=r"m=3 is not a multiple of p; use m=4"):
        interleaved_1f1b(4, 2, 3)
    with pytest.raises(ScheduleError, match="v >= 1 stages per rank"):
        interleaved_1f1b(2, 0, 2)


def _with_rows(schedule: Schedule, rows) -> Schedule:
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, tuple(map(tuple, rows)),
                    max_in_flight=schedule.max_in_flight, placement=schedule.placement)


def test_rules_catch_a_stage_on_the_wrong_rank():
    good = interleaved_1f1b(2, 2, 2)
    rows = [list(r) for r in good.grid]
    rows[0][0] = Action(1, "F", 0)  # stage 1 lives on rank 1
    with pytest.raises(ScheduleError, match=r"step 0: 1F0 is on rank 0's row \(it holds stages \(0, 2\)\)"):
        check(_with_rows(good, rows))


def test_rules_catch_a_missing_cross_rank_dependency():
    good = interleaved_1f1b(2, 2, 2)
    rows = [list(r) for r in good.grid]
    # rank 0 runs 2F0 before rank 1's 1F0 has sent it: swap 2F0 (step 2) with the bubble-free 0F0 slot
    rows[0][0], rows[0][2] = rows[0][2], rows[0][0]
    with pytest.raises(ScheduleError, match=r"step 0: 2F0 runs before 1F0 \(data from stage 1\)"):
        check(_with_rows(good, rows))


def test_rules_catch_a_row_over_its_in_flight_bound():
    good = interleaved_1f1b(2, 2, 2)
    tight = Schedule(good.name, 4, 2, good.grid, max_in_flight=(3, 3), placement=good.placement)
    with pytest.raises(ScheduleError, match=r"rank 0 holds 4 microbatches in flight, above the INTERLEAVED bound 3"):
        check(tight)


def test_placement_must_hold_each_stage_once():
    grid = interleaved_1f1b(2, 2, 2).grid
    with pytest.raises(ScheduleError, match=r"must hold each of stages 0..3 on exactly one row, found \[0, 1, 2, 2\]"):
        Schedule("x", 4, 2, grid, placement=((0, 2), (1, 2)))


def _torch_interleaved_order(p: int, v: int, m: int) -> dict:
    """torch's ScheduleInterleaved1F1B pipeline order for every rank (its IR; stand-in stages, no process group)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=p * v, stage_index=c * p, is_first=False,
                              is_last=False) for c in range(v)]
    return ScheduleInterleaved1F1B(stages, m, loss_fn=None).pipeline_order


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (3, 2, 6), (4, 3, 8)])
def test_order_equals_torchs_and_its_csv_reads_as_ours(p, v, m):
    order = _torch_interleaved_order(p, v, m)
    ours = interleaved_orders(p, v, m)
    for rank in range(p):
        assert [str(a) for a in order[rank] if a is not None] == [str(a) for a in ours[rank]]
    # torch's CSV of it (one row per rank, its idle cells) reads, places and checks as our grid
    text = "\n".join(",".join("" if a is None else str(a) for a in order[rank]) for rank in range(p)) + "\n"
    read = parse_torch_csv(text)
    assert read.placement == loop_placement(p, v) and read.grid == interleaved_1f1b(p, v, m).grid
    assert parse_torch_csv(torch_csv_text(read)).grid == read.grid


def test_make_schedule_needs_the_ranks_and_the_command_line_prints_it(tmp_path, capsys):
    from model_parallel.cli import schedule as schedule_cli
    from model_parallel.runtime.step.schedule import make_schedule

    from model_parallel.runtime.step.interleaved import run_schedule

    with pytest.raises(ScheduleError, match="build it with runtime.step.interleaved.run_schedule"):
        make_schedule("interleaved", 4, 8)
    assert run_schedule("interleaved", 8, 8, 4).grid == interleaved_1f1b(4, 2, 8).grid
    assert run_schedule("1f1b", 4, 8, 4).grid == make_schedule("1f1b", 4, 8).grid
    with pytest.raises(ScheduleError, match="the ranks must divide them"):
        run_schedule("interleaved", 6, 8, 4)
    out = tmp_path / "interleaved.csv"
    assert schedule_cli.main(["interleaved", "-p", "4", "-v", "2", "-m", "4", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "r3 " in printed and "bubble 27.3 % of 4 x 22 unit steps" in printed
    assert "in flight per rank: [8, 8, 7, 5]" in printed
    assert schedule_cli.main([str(out)]) == 0 and "bubble 27.3 %" in capsys.readouterr().out
