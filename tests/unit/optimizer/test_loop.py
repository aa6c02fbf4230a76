"""Loop placements balanced by rank (optimizer/loop.py): p*v stages, stage k on rank k % p, a rank's time the sum of
its stages' cost over its speed; the slowest rank is minimised."""
import random

import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.optimizer.contiguous import straight_plan
from model_parallel.optimizer.loop import is_loop, loop_rank_plan, rank_times
from model_parallel.optimizer.synthetic import chain
from model_parallel.runtime.plancheck import check_plan


def unit_chain(n):
    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", "Linear", forward_ms=0.5, backward_ms=0.5) for i in range(n)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def times_of(graph, plan, ranks, speeds):
    costs = [sum(graph[n].compute_ms for n in s.node_ids) for s in plan.stages]
    return rank_times(costs, ranks, speeds)


def test_equal_speeds_give_the_balanced_split():
    graph = unit_chain(8)
    plan = loop_rank_plan(graph, [0, 1, 0, 1], [1.0] * 4)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)] and plan.loop_width == 2
    assert times_of(graph, plan, [0, 1, 0, 1], {0: 1.0, 1: 1.0}) == {0: 4.0, 1: 4.0}
    assert check_plan(graph, plan, 2, "interleaved").plan.num_stages == 4


def test_the_table_says_its_time_is_the_slowest_ranks_stages_summed():
    plan = loop_rank_plan(unit_chain(8), [0, 1, 0, 1], [1.0] * 4)
    # Each stage costs 2 ms, each rank 4 ms: the footer's number is a rank's sum, and says so.
    assert plan.time_per_minibatch_s == pytest.approx(4e-3)
    assert "time per minibatch (slowest rank, its stages summed): 4.000 ms" in plan.table()
    assert "(slowest stage)" in straight_plan(unit_chain(8), range(2)).table()


def test_a_rank_twice_slower_gets_half_the_work():
    graph = unit_chain(12)
    ranks = [0, 1, 0, 1]
    plan = loop_rank_plan(graph, ranks, [1.0, 0.5, 1.0, 0.5])
    held = {r: sum(len(plan.stages[k].node_ids) for k in plan.stages_of_rank(r)) for r in (0, 1)}
    assert held == {0: 8 + 1, 1: 4} or held == {0: 8, 1: 4 + 1}  # the input node rides with stage 0
    assert max(times_of(graph, plan, ranks, {0: 1.0, 1: 0.5}).values()) == pytest.approx(8.0)


def test_never_worse_than_the_per_stage_split_and_near_the_ideal():
    """Against the straight solver with each stage at its rank's speed (the start): never slower; and within one
    node's time of the ideal (total work / summed speeds), where the straight split is often further off."""
    for seed in range(12):
        rng = random.Random(seed)
        p, v = rng.choice([2, 3, 4]), rng.choice([2, 3])
        graph = chain(rng.randint(30, 70), seed)
        ranks = [k % p for k in range(p * v)]
        speeds = {r: rng.choice([1.0, 0.7, 0.5]) for r in range(p)}
        per_stage = [speeds[r] for r in ranks]
        ours = max(times_of(graph, loop_rank_plan(graph, ranks, per_stage), ranks, speeds).values())
        start = max(times_of(graph, straight_plan(graph, ranks, per_stage), ranks, speeds).values())
        assert ours <= start * (1 + 1e-9)
        ideal = graph.total_compute_ms / sum(speeds.values())
        assert ours <= ideal + max(n.compute_ms for n in graph.nodes) / min(speeds.values())


def test_only_loop_placements_are_planned():
    assert is_loop([0, 1, 0, 1]) and is_loop([0, 1, 2, 0, 1, 2])
    assert not is_loop([0, 1]) and not is_loop([0, 1, 1, 0]) and not is_loop([0, 0, 0])
    with pytest.raises(PlanError, match="a loop placement puts stage k on the rank of stage k % p"):
        loop_rank_plan(unit_chain(8), [0, 1, 1, 0], [1.0] * 4)
    with pytest.raises(PlanError, match="cannot split 2 cut point"):
        loop_rank_plan(unit_chain(2), [0, 1, 0, 1], [1.0] * 4)


@pytest.mark.parametrize("speeds", [(1.0, 1.0), (1.0, 0.5)])
def test_the_optimum_on_a_reference_profile(reference_profiles, speeds):
    """gnmt, 2 ranks x 2 stages: the slowest rank equals the best over every cut triple (brute force over the
    same cut points)."""
    import numpy as np

    from model_parallel.graph.io import load_graph
    from model_parallel.optimizer.contiguous import priced_graph
    from model_parallel.optimizer.states import preprocess, prefix_states

    graph = priced_graph(load_graph(reference_profiles / "gnmt.graph.txt"))
    x = np.concatenate([[0.0], prefix_states(preprocess(graph, "pipedream")).compute * 1000.0])
    s, total = len(x) - 1, x[-1]
    best = np.inf
    for a in range(1, s - 1):
        b, c = np.arange(a + 1, s)[:, None], np.arange(a + 1, s)[None, :]
        rank0 = x[a] + x[c] - x[b]
        best = min(best, float(np.where(c > b, np.maximum(rank0 / speeds[0], (total - rank0) / speeds[1]), np.inf).min()))
    ranks = [0, 1, 0, 1]
    plan = loop_rank_plan(graph, ranks, [speeds[r] for r in ranks])
    costs = [sum(graph[n].compute_ms for n in s.node_ids if not graph[n].is_input) for s in plan.stages]
    assert max(rank_times(costs, ranks, dict(enumerate(speeds))).values()) == pytest.approx(best, rel=1e-9)
