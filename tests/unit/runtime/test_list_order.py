"""Zero-bubble orders list-built from stage times (runtime/step/list_order.py), their plan times and auto's pricing."""
from __future__ import annotations

from dataclasses import replace

import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.plan import Plan, StagePlan, plan_stage_times, with_stage_times
from model_parallel.optimizer.simulate import StageTimes
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.step.auto import Candidate, predict
from model_parallel.runtime.step.interleaved import run_schedule
from model_parallel.runtime.step.actions import grid_from_orders
from model_parallel.runtime.step.list_order import (FIXED, LIST, VARIANTS, held_peaks, list_orders, quantized,
                                                     simulate_schedule, timed_schedule)
from model_parallel.runtime.step.schedule import Schedule, check, format_grid

LAYER_MS = 8.0  # bench/schedules.py's emulated layer: F = I = W = 8 ms


def loop_times(layers: list[int], slow_rank: int, ranks: int = 4) -> list[StageTimes]:
    """bench/schedules.py's straggler plan: stage k holds layers[k] layers on rank k % ranks; `slow_rank` 2x slower."""
    times = []
    for k, n in enumerate(layers):
        ms = LAYER_MS * n * (2.0 if k % ranks == slow_rank else 1.0)
        times.append(StageTimes(ms, 2 * ms, ms, ms))
    return times


STRAGGLER = loop_times([4, 1, 3, 3, 3, 2, 4, 4], slow_rank=1)


def in_flight_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per row, pairs forwarded and not yet through I at the peak: `check`'s count."""
    peaks = []
    for r in range(schedule.num_rows):
        count = peak = 0
        for action in schedule.row_actions(r):
            count += 1 if action.is_forward else -1 if action.sends_gradient else 0
            peak = max(peak, count)
        peaks.append(peak)
    return tuple(peaks)


def skewed(num_stages: int, ranks: int) -> list[StageTimes]:
    """Uneven times: stage k costs 1 + (k * 7) % 5 units, the stages of rank 1 twice that."""
    return [StageTimes(u, 2 * u, u, u) for k in range(num_stages)
            for u in [float(1 + (k * 7) % 5) * (2.0 if k % ranks == 1 else 1.0)]]


CASES = [("zbh1", 4, 4, 4), ("zbh1", 4, 4, 8), ("zbh1", 3, 3, 5), ("zbinterleaved", 8, 4, 8), ("zbinterleaved", 4, 2, 4),
         ("zbinterleaved", 6, 2, 6), ("zbinterleaved", 8, 4, 4), ("zbv", 8, 4, 8), ("zbv", 4, 2, 4), ("zbv", 6, 3, 9)]


@pytest.mark.parametrize("name, stages, ranks, m", CASES)
def test_list_built_orders_pass_the_rules_within_the_base_memory(name: str, stages: int, ranks: int, m: int) -> None:
    base = run_schedule(name, stages, m, ranks)
    built = 0
    for times in (skewed(stages, ranks), loop_times([1 + k % 3 for k in range(stages)], 0, ranks), STRAGGLER[:stages]):
        for variant in VARIANTS:  # every variant's grid, chosen or not
            orders = list_orders(base, times, *variant)
            if orders is None:
                continue
            built += 1
            grid = replace(base, grid=grid_from_orders(orders, stages), order=LIST)
            check(grid)  # stage order per kind, dependencies, W after I, and the base's in-flight bound
            assert all(a <= b for a, b in zip(in_flight_peaks(grid), base.max_in_flight))
            assert all(a <= b for a, b in zip(held_peaks(grid), held_peaks(base)))  # held until W: the priced memory
        timed = timed_schedule(base, times)
        assert (timed.name, timed.placement, timed.max_in_flight) == (base.name, base.placement, base.max_in_flight)
        assert simulate_schedule(timed, times).makespan_ms <= simulate_schedule(base, times).makespan_ms
    assert built >= 6


@pytest.mark.parametrize("name, stages, ranks, m", CASES)
def test_equal_times_keep_the_fixed_order(name: str, stages: int, ranks: int, m: int) -> None:
    base = run_schedule(name, stages, m, ranks)
    assert timed_schedule(base, [StageTimes(8.0, 16.0, 8.0, 8.0)] * stages) is base


def test_the_straggler_plan_runs_at_least_2_percent_faster() -> None:
    base = run_schedule("zbinterleaved", 8, 8, 4)
    timed = timed_schedule(base, STRAGGLER)
    assert timed.order == LIST and base.order == FIXED
    before, after = simulate_schedule(base, STRAGGLER).makespan_ms, simulate_schedule(timed, STRAGGLER).makespan_ms
    assert (before, after) == (1520.0, 1480.0)  # -2.6 %; a greedy with more memory than the base's reaches 1456
    assert "order=list" in format_grid(timed).splitlines()[0] and "order=" not in format_grid(base)


def test_the_build_is_deterministic() -> None:
    base = run_schedule("zbinterleaved", 8, 8, 4)
    assert timed_schedule(base, STRAGGLER) == timed_schedule(base, list(STRAGGLER))


def test_other_schedules_and_missing_splits_keep_the_base() -> None:
    one = run_schedule("1f1b", 4, 8, 4)
    assert timed_schedule(one, skewed(4, 4)) is one
    zb = run_schedule("zbinterleaved", 8, 8, 4)
    assert timed_schedule(zb, [StageTimes(t.forward_ms, t.backward_ms) for t in STRAGGLER]) is zb
    assert timed_schedule(zb, None) is zb


def test_auto_prices_the_order_the_run_builds() -> None:
    fixed = predict(Candidate("zbinterleaved", tuple(STRAGGLER)), 8, 4)
    listed = predict(Candidate("zbinterleaved", tuple(STRAGGLER), list_order=True), 8, 4)
    assert (fixed.order, fixed.step_ms, listed.order, listed.step_ms) == (FIXED, 1520.0, LIST, 1480.0)


def _plan(stage_times: object) -> dict:
    plan = Plan(tuple(StagePlan(k, (f"n{k}",)) for k in range(2)), extra={"stage_times": stage_times})
    return plan.to_dict()


def test_plan_stage_times_are_read_and_checked() -> None:
    plan = Plan.from_dict(_plan([[1, 2.5, 2.5], [2.0, 0, 4]]))
    assert plan_stage_times(plan) == ((1.0, 2.5, 2.5), (2.0, 0.0, 4.0))
    assert plan_stage_times(replace(plan, extra={})) is None
    # What the coordinator and PipelineTrainer's rank 0 attach: read back as given, through JSON
    attached = with_stage_times(replace(plan, extra={}), [StageTimes(1.0, 3.0, 1.0, 2.0), StageTimes(2.0, 2.0, 0.5, 1.5)])
    assert plan_stage_times(Plan.from_dict(attached.to_dict())) == ((1.0, 1.0, 2.0), (2.0, 0.5, 1.5))


@pytest.mark.parametrize("given, match", [
    ([[1, 2, 3]], "1 entries for 2 stage"),
    ({"0": [1, 2, 3]}, "dict entries for 2 stage"),
    ([[1, 2, 3], [1, 2]], "stage 1 has"),
    ([[1, 2, 3], [1, -2, 3]], "stage 1 has a negative time"),
    ([[1, 2, 3], [1, "nan", 3]], "stage 1's time must be a finite number"),
    ([[1, 2, 3], [1, True, 3]], "stage 1's time must be a finite number"),
])
def test_bad_plan_stage_times_are_refused_when_read(given: object, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(_plan(given), "p.json")


def test_the_order_flag_is_checked() -> None:
    assert TrainConfig().schedule_order == LIST and TrainConfig(schedule_order="fixed").schedule_order == FIXED
    with pytest.raises(ValueError, match="schedule_order must be one of list, fixed, got 'torch'"):
        TrainConfig(schedule_order="torch")


def test_the_schedule_command_shows_the_list_built_order(capsys: pytest.CaptureFixture[str]) -> None:
    from model_parallel.cli import schedule as schedule_cli

    times = "/".join(f"{t.forward_ms:g},{t.input_ms:g},{t.weight_ms:g}" for t in STRAGGLER)
    assert schedule_cli.main(["zbinterleaved", "-p", "4", "-m", "8", "--times", times]) == 0
    listed = capsys.readouterr().out
    assert schedule_cli.main(["zbinterleaved", "-p", "4", "-m", "8", "--times", times, "--order", "fixed"]) == 0
    fixed = capsys.readouterr().out
    assert "zbinterleaved p=8 ranks=4 m=8 order=list" in listed and "simulated: 1480.0 ms per step" in listed
    assert "order=" not in fixed and "simulated: 1520.0 ms per step" in fixed


def test_measured_speeds_near_the_straggler_still_get_a_list_order() -> None:
    # The live bench's plan and the times the coordinator attached (speeds 0.997 / 0.508, the first layer's backward
    # w only): built from these exact times no variant gains; built from them rounded to 5 % of their median
    # (`quantized`), one does, judged on the exact times.
    times = []
    for k, n in enumerate([3, 2, 3, 3, 4, 1, 4, 4]):
        speed, backward = 0.508 if k % 4 == 1 else 0.997, 16.0 * n - (8.0 if k == 0 else 0.0)
        times.append(StageTimes(8.0 * n / speed, backward / speed, backward / 2 / speed, backward / 2 / speed))
    base = run_schedule("zbinterleaved", 8, 8, 4)
    timed = timed_schedule(base, times)
    before, after = simulate_schedule(base, times).makespan_ms, simulate_schedule(timed, times).makespan_ms
    assert timed.order == LIST and after < 0.97 * before, (before, after)  # 1509.9 -> 1458.0 ms: -3.4 %
    rounded = quantized([StageTimes(7.9, 16.2, 8.1, 8.1), StageTimes(16.1, 31.0, 15.6, 15.4)], 0.05)[1]
    # multiples of 0.77 (5 % of the upper median, 15.4): 21, 20 and 20 of them
    assert [rounded.forward_ms, rounded.input_ms, rounded.weight_ms] == pytest.approx([16.17, 15.4, 15.4])


def test_zbv_with_fewer_microbatches_than_its_v_needs_gets_a_better_order_even_at_equal_times() -> None:
    # torch's ZBV order is built for m >= 2p - 1; at m = p it drops the microbatches past m and idles 20 %.
    base = run_schedule("zbv", 8, 4, 4)
    times = [StageTimes(2.0, 4.0, 2.0, 2.0)] * 8
    timed = timed_schedule(base, times)
    check(timed)
    assert timed.order == LIST
    assert (simulate_schedule(base, times).bubble, simulate_schedule(timed, times).bubble) == pytest.approx((0.2, 1 / 9))
