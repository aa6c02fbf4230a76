"""Rebalancing policy: speed estimates, calibration, hysteresis, cooldown, the chain solver."""
import copy
import random
import re

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.solver import default_solver, plan_for_workers
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan


def chain_graph(costs):
    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=c / 2, backward_ms=c / 2) for i, c in enumerate(costs)]
    edges = [(a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])]
    return Graph(tuple(nodes), tuple(edges))


def even_plan(graph, p):
    ids = list(graph.topological_order)
    per = (len(ids) - 1) // p
    bounds = [0] + [1 + per * k for k in range(1, p)] + [len(ids)]
    return Plan(tuple(StagePlan(k, tuple(ids[bounds[k]:bounds[k + 1]]), ranks=(k,)) for k in range(p)))


def decide(graph, plan, samples, config, steps_since_switch, force=False, **memory):
    """One evaluation from a fresh policy state holding `memory` (misses, baseline, ...), `steps_since_switch`
    steps after `plan` went live."""
    state = pol.PolicyState(graph, plan, **memory)
    decision, _ = pol.decide(state, pol.Samples(steps_since_switch, samples), config, force=force)
    return decision


def measure(graph, plan, speeds, calibration=1.0, noise=0.0, rng=None, n=5):
    out = {}
    for stage in plan.stages:
        base = pol.stage_profiled_ms(graph, stage) * calibration / speeds[stage.ranks[0]]
        out[stage.ranks[0]] = [base * (1 + (rng.uniform(-noise, noise) if rng else 0)) for _ in range(n)]
    return out


def test_estimate_speeds_and_calibration():
    graph = chain_graph([1.0] * 8)
    plan = even_plan(graph, 4)
    est = pol.estimate_speeds(graph, plan, measure(graph, plan, {0: 1, 1: 1, 2: 0.5, 3: 1}, calibration=3.0))
    assert est.calibration == pytest.approx(3.0)
    assert est.speeds == pytest.approx({0: 1.0, 1: 1.0, 2: 0.5, 3: 1.0})
    assert est.measured_ms[2] == pytest.approx(12.0)
    with pytest.raises(PlanError, match="rank 3 \\(stage 3\\) has no compute samples"):
        pol.estimate_speeds(graph, plan, {0: [1.0], 1: [1.0], 2: [1.0]})


def test_median_ignores_outliers():
    graph = chain_graph([1.0] * 4)
    plan = even_plan(graph, 2)
    est = pol.estimate_speeds(graph, plan, {0: [2, 2, 2, 50, 2], 1: [2, 2, 1000, 2, 2]})
    assert est.speeds == pytest.approx({0: 1.0, 1: 1.0})


def test_default_solver_is_optimal_for_speeds():
    graph = chain_graph([1.0] * 12)
    plan = default_solver(graph, [0, 1, 2], [1.0, 0.5, 1.0])
    sizes = [len([n for n in s.node_ids if n != "input0"]) for s in plan.stages]
    assert sizes == [5, 2, 5]
    assert plan.stages[0].node_ids[0] == "input0"
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (2,)]
    assert plan.time_per_minibatch_s == pytest.approx(5e-3)
    with pytest.raises(PlanError, match="cannot split 12 layer node\\(s\\) into 14 stage"):
        default_solver(graph, list(range(14)), [1.0] * 14)


def test_noisy_balanced_pipeline_never_switches():
    graph = chain_graph([1.0] * 8)
    plan = even_plan(graph, 4)
    rng = random.Random(0)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=0, window=5)
    for _ in range(200):
        samples = measure(graph, plan, {r: 1.0 for r in range(4)}, calibration=2.0, noise=0.08, rng=rng)
        decision = decide(graph, plan, samples, config, steps_since_switch=100, solver=default_solver)
        assert decision.plan is None, decision.reason


def test_slowed_worker_switches_once_then_stays():
    graph = chain_graph([1.0] * 16)
    plan = even_plan(graph, 4)
    speeds = {0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0}
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=10, window=5)
    rng = random.Random(1)
    switches = []
    since = 100
    for step in range(300):
        samples = measure(graph, plan, speeds, noise=0.05, rng=rng)
        decision = decide(graph, plan, samples, config, steps_since_switch=since, solver=default_solver)
        since += 1
        if decision.plan is not None:
            switches.append(step)
            assert decision.plan.version == plan.version + 1
            assert decision.gain > 0.1
            plan, since = decision.plan, 0
    assert len(switches) == 1
    sizes = [len([n for n in s.node_ids if n != "input0"]) for s in plan.stages]
    assert sizes[1] < sizes[0]  # work moved off the slow rank 1
    assert pol.predicted_bottleneck_ms(graph, plan, speeds) < 8.0


def test_window_and_cooldown_gate_the_decision():
    graph = chain_graph([1.0] * 8)
    plan = even_plan(graph, 2)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=10, window=5)
    samples = measure(graph, plan, {0: 1.0, 1: 0.5}, n=3)
    assert "waiting for 5 samples" in decide(graph, plan, samples, config, 50).reason
    samples = measure(graph, plan, {0: 1.0, 1: 0.5}, n=5)
    switched_once = Plan(plan.stages, version=1)  # the cooldown runs between switches
    assert "cooldown: 3 of 10" in decide(graph, switched_once, samples, config, 3).reason
    forced = decide(graph, plan, measure(graph, plan, {0: 1.0, 1: 0.5}, n=1), config, 0, force=True)
    assert forced.plan is not None and forced.plan.version == 1


def test_short_run_switches_before_the_first_cooldown_when_the_imbalance_is_plain():
    """The cooldown counts from the start before the first switch: a 10-step run would never rebalance."""
    graph = chain_graph([1.0] * 40)
    plan = even_plan(graph, 2)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=20, window=5)
    plain = decide(graph, plan, measure(graph, plan, {0: 1.0, 1: 0.5}), config, 5)  # 2x slower rank: 33% gain
    assert plain.plan is not None and plain.plan.version == 1, plain.reason
    # The numbers are the slowest rank's compute (measured now, predicted after), not the step time (QA: it read
    # "predicted 191.90 -> 153.10 ms per step" beside auto's 175.1 ms/step for the same plan).
    assert re.fullmatch(r"predicted [0-9.]+ -> [0-9.]+ ms per step of the slowest rank's compute \([0-9.]+% gain\)",
                        plain.reason), plain.reason
    marginal = decide(graph, plan, measure(graph, plan, {0: 1.0, 1: 0.75}), config, 5)  # 23/17 split: 14% gain
    assert marginal.plan is None and "cooldown: 5 of 20 steps since the start" in marginal.reason, marginal.reason
    assert decide(graph, plan, measure(graph, plan, {0: 1.0, 1: 0.75}), config, 20).plan is not None


def test_calibration_fixes_a_wrong_profile():
    """The profile says the layers are uniform; really the last half costs 3x. Both workers are equally fast."""
    profiled = chain_graph([1.0] * 8)
    true = chain_graph([1.0] * 4 + [3.0] * 4)
    plan = even_plan(profiled, 2)
    samples = {s.ranks[0]: [pol.stage_profiled_ms(true, s)] * 5 for s in plan.stages}
    decision = decide(profiled, plan, samples, pol.PolicyConfig(cooldown_steps=0), 100, solver=default_solver)
    assert decision.plan is not None
    assert decision.estimate.speeds[1] == pytest.approx(1 / 3)
    # true bottleneck improves from 12 to at most 9 (the slow-looking stage got fewer layers)
    new_true = max(pol.stage_profiled_ms(true, s) for s in decision.plan.stages)
    assert new_true < 12.0


def test_policy_config_validation():
    with pytest.raises(PlanError, match="--threshold must be in"):
        pol.PolicyConfig(threshold=1.5)
    with pytest.raises(PlanError, match="--window must be >= 1"):
        pol.PolicyConfig(window=0)


def test_plan_for_workers_uses_given_ranks():
    graph = chain_graph([1.0] * 6)
    plan = plan_for_workers(graph, [1, 3], [1.0, 1.0], version=4, solver=default_solver)
    assert [s.ranks for s in plan.stages] == [(1,), (3,)] and plan.version == 4
    with pytest.raises(PlanError, match="at least one worker"):
        plan_for_workers(graph, [], [], version=1)


def test_unprofiled_graph_gets_a_byte_proxy():
    graph = chain_graph([0.0] * 4)
    graph = graph.replace_nodes(n if n.is_input else __import__("dataclasses").replace(n, parameter_size=2e6) for n in graph.nodes)
    proxied = pol.with_cost_proxy(graph)
    assert [n.compute_ms for n in proxied.nodes] == [0.0, 2.0, 2.0, 2.0, 2.0]
    assert pol.with_cost_proxy(proxied) is proxied


def test_delivered():
    assert pol.delivered(10.0, 6.0, 7.5)  # predicted 40%, got 25% >= 20%
    assert not pol.delivered(10.0, 6.0, 9.5)
    assert pol.PolicyConfig(threshold=0.1).threshold_after(5) == 0.3
    assert pol.PolicyConfig(cooldown_steps=10).cooldown_after(7) == 40


def simulate(graph, plan, true_ms, config, steps, rng, noise):
    """The coordinator's loop in miniature: measure, decide, switch; the policy's own state reviews each switch
    and backs off. Returns switch steps and the final plan."""
    switches = []
    state = pol.PolicyState(graph, plan, solver=default_solver, version_start_step=-10 ** 6)
    for step in range(steps):
        samples = {s.ranks[0]: [true_ms(s, step) * (1 + rng.uniform(-noise, noise)) for _ in range(config.window)]
                   for s in state.plan.stages}
        if step - state.version_start_step <= config.window:
            continue  # the new plan's first window is filling
        decision, state = pol.decide(state, pol.Samples(step, samples), config)
        if decision.plan is not None:
            switches.append(step)
            state = pol.switched(state, decision.plan, step, predicted=True)
    return switches, state.plan


def test_backoff_stops_oscillation_when_the_profile_misleads():
    """Hidden per-node costs the profile misses (odd nodes cost 2x more than profiled) + 25% noise:
    the policy may try a few plans but must settle, not switch every cooldown."""
    graph = chain_graph([1.0] * 24)
    hidden = {f"n{i}": (3.0 if i % 2 else 1.0) * (1 + 0.5 * (i > 18)) for i in range(24)}
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=5, window=5)

    def true_ms(stage, step):
        return sum(hidden.get(n, 0.0) for n in stage.node_ids)

    switches, _ = simulate(graph, even_plan(graph, 4), true_ms, config, 400, random.Random(3), noise=0.25)
    assert len(switches) <= 3 and (not switches or switches[-1] < 200), switches


def test_straggler_detected_after_a_steady_period():
    """Balanced and steady for 100 steps (noise 15%), then rank 2 turns 2x slower: exactly one switch, soon after."""
    graph = chain_graph([1.0] * 24)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=5, window=5)

    def true_ms(stage, step):
        slow = 2.0 if (stage.ranks[0] == 2 and step >= 100) else 1.0
        return slow * pol.stage_profiled_ms(graph, stage) * 3.0

    switches, plan = simulate(graph, even_plan(graph, 4), true_ms, config, 300, random.Random(4), noise=0.15)
    assert len(switches) == 1 and 100 <= switches[0] < 110, switches
    sizes = [len([n for n in s.node_ids if n != "input0"]) for s in plan.stages]
    assert sizes[2] < min(sizes[0], sizes[1], sizes[3]), sizes


def test_a_burst_of_contention_is_not_a_straggler():
    """Rank 1 looks 3x slower for 2 steps (a burst), then recovers: no switch; a lasting change switches."""
    graph = chain_graph([1.0] * 16)
    plan = even_plan(graph, 4)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=0, window=1, persist=3)
    baseline = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    slow = measure(graph, plan, {0: 1.0, 1: 1 / 3, 2: 1.0, 3: 1.0}, n=1)
    first = decide(graph, plan, slow, config, 100, solver=default_solver, baseline=baseline, change_streak=0)
    assert first.plan is None and first.extra["changed"] == 1 and "seen 1 of 3 times" in first.reason
    third = decide(graph, plan, slow, config, 100, solver=default_solver, baseline=baseline, change_streak=2)
    assert third.plan is not None
    steady = decide(graph, plan, measure(graph, plan, {r: 1.0 for r in range(4)}, n=1), config, 100,
                        solver=default_solver, baseline=baseline, change_streak=2)
    assert steady.plan is None and "speeds steady" in steady.reason and not steady.extra


def test_decide_is_pure_and_threads_its_memory():
    """Same inputs, same outputs, inputs untouched; the memory (prediction, review, baseline) travels in the state."""
    graph = chain_graph([1.0] * 16)
    plan = even_plan(graph, 4)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=0, window=5)
    speeds = {0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0}
    state = pol.PolicyState(graph, plan, solver=default_solver)
    samples = pol.Samples(10, measure(graph, plan, speeds))
    state_before, samples_before = copy.deepcopy(state), copy.deepcopy(samples)
    first = pol.decide(state, samples, config)
    assert pol.decide(state, samples, config) == first
    assert state == state_before and samples == samples_before
    decision, after = first
    assert decision.plan is not None and after.prediction == (decision.current_ms, decision.predicted_ms)
    assert state.prediction is None  # the input state did not learn it
    live = pol.switched(after, decision.plan, 11, predicted=True)
    assert (live.plan.version, live.version_start_step, live.learn_baseline, live.review) == (1, 11, True, after.prediction)
    # The new plan's first full window: its switch is judged (it delivered), its baseline learned, nothing proposed.
    judged, learned = pol.decide(live, pol.Samples(20, measure(graph, live.plan, speeds)), config)
    assert judged.plan is None and "learned the speeds under plan v1" in judged.reason
    assert judged.review is not None and judged.review.version == 1 and judged.review.delivered
    assert learned.review is None and learned.baseline is not None and not learned.learn_baseline and learned.misses == 0
    assert not pol.switched(after, decision.plan, 11, predicted=False).review  # set-plan/scale: nothing to judge

