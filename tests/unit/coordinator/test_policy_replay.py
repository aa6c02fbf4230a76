"""The policy replayed step by step on scripted speeds, as the coordinator runs it (rolling samples per plan)."""
import random

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.solver import default_solver, plan_for_workers
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan

CALIBRATION = 3.0  # the machine runs the profile 3x slower (measured = profiled * 3 / speed)


def chain_graph(n):
    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=0.5, backward_ms=0.5) for i in range(n)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def even_plan(graph, p):
    ids = list(graph.topological_order)
    per = (len(ids) - 1) // p
    bounds = [0] + [1 + per * k for k in range(1, p)] + [len(ids)]
    return Plan(tuple(StagePlan(k, tuple(ids[bounds[k]:bounds[k + 1]]), ranks=(k,)) for k in range(p)))


def replay(graph, plan, speed, config, steps, noise=0.0, seed=0, state=None):
    """Run `steps` steps: each active rank measures its stage's calibrated profiled ms / speed(rank, step), with
    uniform +-`noise`; samples are kept per plan version past one warm-up step (rebalancer.samples); a proposed plan
    goes live at the next step (rebalancer.confirm). Returns (switch steps, final state, decisions by step)."""
    rng = random.Random(seed)
    state = state or pol.PolicyState(graph, plan, solver=default_solver)
    history, switches, decisions = {}, [], {}
    for step in range(steps):
        first = state.version_start_step + 1
        for stage in state.plan.stages:
            rank = stage.ranks[0]
            ms = pol.stage_profiled_ms(graph, stage) * CALIBRATION / speed(rank, step)
            history.setdefault(rank, []).append((step, state.plan.version, ms * (1 + rng.uniform(-noise, noise))))
        samples = {r: [ms for s, v, ms in h if v == state.plan.version and s >= first] for r, h in history.items()}
        decision, state = pol.decide(state, pol.Samples(step, samples), config)
        decisions[step] = decision
        if decision.plan is not None:
            switches.append(step)
            state = pol.switched(state, decision.plan, step + 1, predicted=True)
    return switches, state, decisions


def stage_sizes(plan):
    return [len([n for n in s.node_ids if n != "input0"]) for s in plan.stages]


def test_a_slowdown_right_after_a_switch_is_acted_on_within_10_steps():
    """The blind spot of issue 37: an early calibration switch (rank 1 runs at half speed from the start), then
    rank 2 turns 2x slower two steps after that switch went live, inside the window that used to become the new
    plan's speed baseline (so the slowdown was taken for normal and never acted on)."""
    graph = chain_graph(24)
    config = pol.PolicyConfig()  # the coordinator's defaults: window 5, cooldown 20, persist 3

    def speed(rank, step):
        return {1: 0.5, 2: 0.5 if step >= 8 else 1.0}.get(rank, 1.0)

    switches, state, decisions = replay(graph, even_plan(graph, 4), speed, config, 80)
    assert switches[0] == 5  # the calibration switch: plan v1 live from step 6, rank 2 slowed from step 8
    assert len(switches) == 2 and switches[1] <= 8 + 10, [(s, decisions[s].reason) for s in switches]
    sizes = stage_sizes(state.plan)
    assert sizes[1] < sizes[0] and sizes[2] < sizes[3], sizes  # work moved off both slow ranks
