"""The policy on ranks that spend a fixed time per step whatever their stage holds (coordinator/speeds.py): the
overhead is learned at a switch, so a straggler that recovers while holding the small share it was given gets its work
back, and the overhead never makes a balanced pipeline switch."""
import math
import random

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.solver import default_solver
from model_parallel.coordinator.speeds import FIT_CONFIDENCE, fit_overhead
from tests.unit.coordinator.test_policy_replay import CALIBRATION, chain_graph, even_plan, stage_sizes
from tests.unit.coordinator.test_policy_replay import replay as policy_replay

OVERHEAD = 1.5  # ms per step on every rank; a stage of 4 layers computes 12 ms (1 ms profiled x 3 per layer)


def replay(graph, plan, speed, steps, noise=0.0, seed=0):
    """test_policy_replay.replay with the default policy, every rank also spending OVERHEAD ms per step."""
    switches, state, _ = policy_replay(graph, plan, speed, pol.PolicyConfig(), steps, noise, seed, overhead=OVERHEAD)
    return switches, state


@pytest.mark.parametrize("slow", [0.5, 1 / 3])
def test_a_straggler_that_recovers_while_holding_a_small_share_gets_its_work_back(slow):
    graph = chain_graph(16)
    switches, state = replay(graph, even_plan(graph, 4), lambda r, s: slow if r == 2 and 60 <= s < 140 else 1.0, 220,
                             noise=0.02)
    # Read without the overhead, rank 2 holding 1 layer (3 ms of work, 4.5 ms measured) looked 1.5x slow after it
    # recovered, and no plan was predicted faster: it kept 1 of 16 layers for good, the step 5/4 of what it can be.
    assert len(switches) == 2 and 60 <= switches[0] < 70 and 140 <= switches[1] < 150, switches
    assert stage_sizes(state.plan) == [4, 4, 4, 4]
    assert state.overhead_ms == pytest.approx(OVERHEAD, rel=0.25)


def test_the_overhead_is_learned_from_ranks_whose_work_moved_at_a_switch():
    def point(work, speed=1.0, error=0.0):  # 2 ms fixed, 3 ms per profiled ms
        return work, 2.0 + 3.0 * work / speed, error

    before = {0: point(4), 1: point(4), 2: point(4, 0.5), 3: point(4)}
    after = {0: point(5), 1: point(6), 2: point(1, 0.5), 3: point(6, 0.25)}
    # Rank 0's work moved 20 %: too close to fit; rank 3 slowed at the switch: its fit is wrong, the median is not.
    assert fit_overhead(before, after) == pytest.approx(2.0)
    assert fit_overhead(before, before) is None  # nothing moved: nothing to fit
    # Only what a fit shows beyond FIT_CONFIDENCE standard errors: rank 2's medians +-0.1 ms, its work 4 -> 1 ms.
    noisy = {2: point(4, 0.5, 0.1)}, {2: point(1, 0.5, 0.1)}
    assert fit_overhead(*noisy) == pytest.approx(2.0 - FIT_CONFIDENCE * math.hypot(1 * 0.1, 4 * 0.1) / 3)
    # Never negative, never (nearly) all of the quickest rank's time.
    assert fit_overhead({0: (4.0, 4.0, 0.0)}, {0: (2.0, 1.0, 0.0)}) == 0.0
    assert fit_overhead({0: (4.0, 10.0, 0.0)}, {0: (1.0, 9.9, 0.0)}) == pytest.approx(0.8 * 9.9)


def test_a_rank_whose_time_is_almost_all_overhead_keeps_its_last_read_speed():
    graph = chain_graph(8)
    plan = even_plan(graph, 2)
    est = pol.estimate_speeds(graph, plan, {0: [2.0 + 12.0], 1: [2.0 + 12.0 / 0.5]}, overhead_ms=2.0)
    assert est.speeds == pytest.approx({0: 1.0, 1: 0.5}) and est.calibration == pytest.approx(3.0)
    # Rank 1's 2.1 ms is nearly all the 2 ms fixed: 0.1 ms of work says no speed; it keeps the one it had.
    est = pol.estimate_speeds(graph, plan, {0: [14.0], 1: [2.1]}, overhead_ms=2.0, known={1: 0.4})
    assert est.speeds[1] == 0.4


@pytest.mark.parametrize("seed", range(3))
def test_a_noisy_balanced_pipeline_with_an_overhead_never_switches(seed):
    graph = chain_graph(16)
    switches, _ = replay(graph, even_plan(graph, 4), lambda r, s: 1.0, 300, noise=0.12, seed=seed)
    assert switches == []


def test_a_slowdown_right_after_a_switch_is_acted_on_within_10_steps_with_an_overhead():
    graph = chain_graph(24)
    # Rank 1 slows at step 40; the switch for it goes live at step 45, and rank 3 slows that very step: the window
    # that teaches the overhead holds rank 3's change too.
    slow = lambda r, s: 0.5 if (r == 1 and s >= 40) or (r == 3 and s >= 45) else 1.0  # noqa: E731
    switches, state = replay(graph, even_plan(graph, 4), slow, 120, noise=0.02)
    assert switches[0] == 44 and 45 <= switches[1] <= 55 and len(switches) == 2, switches
    sizes = stage_sizes(state.plan)
    assert sizes[1] < sizes[0] and sizes[3] < sizes[2]  # both slowed ranks hold less
    # Each switch's fit multiplies the noise by work / its change (here 2 % noise, a 25-50 % move): roughly right.
    assert 0.5 * OVERHEAD < state.overhead_ms < 1.5 * OVERHEAD


def test_the_rebalancer_learns_the_overhead_through_reports_and_ctl_status_says_it():
    """The same recovery through the coordinator's report path (samples past warm-up per plan version, a switch
    confirmed by the first report of the new version), and the line `ctl status` prints for the overhead."""
    from model_parallel.cli.ctl import format_status
    from model_parallel.coordinator.rebalancer import Rebalancer
    from model_parallel.coordinator.status import WorkerState
    from model_parallel.messages import StepReport

    graph = chain_graph(16)
    rebalancer = Rebalancer(graph, even_plan(graph, 4), pol.PolicyConfig(), default_solver, auto=True, world_size=4)
    workers = {r: WorkerState(rank=r, host="h", pid=r, world_size=4) for r in range(4)}
    sent, running = [], rebalancer.plan  # the plan the workers run: a sent switch from the next step
    rng = random.Random(0)
    for step in range(1, 200):
        if sent and sent[-1].plan.version > running.version:
            running = sent[-1].plan
        speed = {r: 0.5 if r == 2 and 40 <= step < 100 else 1.0 for r in range(4)}
        for stage in running.stages:
            rank = stage.ranks[0]
            ms = OVERHEAD + pol.stage_profiled_ms(graph, stage) * CALIBRATION / speed[rank]
            ms *= 1 + rng.uniform(-0.02, 0.02)
            report = StepReport(rank, step, running.version, stage.stage_id, ms, ms, 0.0, 0.0, 1.0)
            workers[rank].reports.append(report)
            workers[rank].step = step
            rebalancer.on_report(workers[rank], report, workers, lambda r, c: sent.append(c) or True, False)
    assert [c.plan.version for c in sent] == [1, 2] and stage_sizes(rebalancer.plan) == [4, 4, 4, 4]
    applied = [h["applied_at_step"] for h in rebalancer.history]
    assert 40 <= applied[0] <= 50 and 100 <= applied[1] <= 110, applied
    status = {**rebalancer.summary(workers), "policy": "auto", "workers": []}
    assert status["overhead_fits"] >= 1 and status["overhead_ms"] == pytest.approx(OVERHEAD, rel=0.25)
    assert f"speeds read after a fixed {status['overhead_ms']:.2f} ms per step every rank spends" in format_status(status)
