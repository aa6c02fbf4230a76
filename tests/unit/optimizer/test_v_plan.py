"""V placements balanced by rank (optimizer/loop.py `v_rank_plan`): 2p stages, stage k on rank k for k < p and on
rank 2p-1-k after, a rank's time the sum of its two stages' cost over its speed; the slowest rank is minimised."""
import itertools
import random

import pytest

from model_parallel.errors import PlanError
from model_parallel.optimizer.contiguous import straight_plan
from model_parallel.optimizer.loop import is_loop, is_v, rank_times, v_rank_plan
from model_parallel.optimizer.synthetic import chain
from model_parallel.runtime.plancheck import check_plan
from tests.unit.optimizer.test_loop import times_of, unit_chain


def v_ranks(p):
    return [min(k, 2 * p - 1 - k) for k in range(2 * p)]


def brute_force(graph, ranks, speeds):
    """The slowest rank of the best split over every placement of the 2p-1 cuts between layer nodes."""
    costs = [n.compute_ms for n in graph.nodes if not n.is_input]
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), len(ranks) - 1):
        bounds = (0, *cuts, len(costs))
        stage_costs = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        best = min(best, max(rank_times(stage_costs, ranks, speeds).values()))
    return best


def test_only_v_placements_are_planned():
    assert is_v([0, 1, 1, 0]) and is_v([0, 1, 2, 2, 1, 0]) and is_v([3, 5, 5, 3])
    assert not is_v([0, 1, 0, 1]) and not is_v([0, 0]) and not is_v([0, 1, 1, 0, 0]) and not is_v([0, 0, 0, 0])
    assert not is_loop([0, 1, 1, 0])
    with pytest.raises(PlanError, match="a V placement puts 2p stages on p >= 2 ranks, stage k on the rank of stage 2p-1-k"):
        v_rank_plan(unit_chain(8), [0, 1, 0, 1], [1.0] * 4)


def test_equal_speeds_give_the_balanced_v_that_zbv_runs():
    graph = unit_chain(8)
    plan = v_rank_plan(graph, [0, 1, 1, 0], [1.0] * 4)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)] and plan.v_width == 2
    assert times_of(graph, plan, [0, 1, 1, 0], {0: 1.0, 1: 1.0}) == {0: 4.0, 1: 4.0}
    assert check_plan(graph, plan, 2, "zbv").plan.num_stages == 4
    assert "time per minibatch (slowest rank, its stages summed): 4.000 ms" in plan.table()


def test_a_slowed_rank_gets_less():
    graph = unit_chain(12)
    ranks = v_ranks(2)
    plan = v_rank_plan(graph, ranks, [1.0, 0.5, 0.5, 1.0])
    held = {r: sum(len(plan.stages[k].node_ids) for k in plan.stages_of_rank(r)) for r in (0, 1)}
    assert held == {0: 8 + 1, 1: 4}  # half rank 0's layers (+ the input node, which rides with stage 0)
    assert max(times_of(graph, plan, ranks, {0: 1.0, 1: 0.5}).values()) == pytest.approx(8.0)


@pytest.mark.parametrize("seed", range(16))
def test_against_brute_force_on_small_chains_and_never_worse_than_the_start(seed):
    """Every cut placement tried (9-13 layers of 0.1-17 ms, mixed speeds): with 2 ranks the search finds the best
    slowest rank; with 3 (5 segments, so moves of up to three cuts can stall) it stays within one node's time of it.
    Never worse than the straight solver with each stage at its rank's speed (the search's start)."""
    rng = random.Random(seed)
    p = 2 if seed % 2 else 3
    graph = chain(rng.randint(9, 13), seed)
    ranks = v_ranks(p)
    speeds = {r: rng.choice([1.0, 0.7, 0.5]) for r in range(p)}
    per_stage = [speeds[r] for r in ranks]
    plan = v_rank_plan(graph, ranks, per_stage)
    assert plan.v_width == p
    ours = max(times_of(graph, plan, ranks, speeds).values())
    start = max(times_of(graph, straight_plan(graph, ranks, per_stage), ranks, speeds).values())
    assert ours <= start * (1 + 1e-9)
    best = brute_force(graph, ranks, speeds)
    if p == 2:
        assert ours == pytest.approx(best, rel=1e-9)
    else:
        assert best <= ours <= best + max(n.compute_ms for n in graph.nodes) / min(speeds.values())


def test_near_the_ideal_on_longer_chains():
    """30-70 layers, p = 2..4, mixed speeds: within one node's time of the ideal (total work / summed speeds), which
    the per-stage start often is not."""
    for seed in range(12):
        rng = random.Random(seed)
        p = rng.choice([2, 3, 4])
        graph = chain(rng.randint(30, 70), seed)
        ranks = v_ranks(p)
        speeds = {r: rng.choice([1.0, 0.7, 0.5]) for r in range(p)}
        ours = max(times_of(graph, v_rank_plan(graph, ranks, [speeds[r] for r in ranks]), ranks, speeds).values())
        ideal = graph.total_compute_ms / sum(speeds.values())
        assert ideal <= ours <= ideal + max(n.compute_ms for n in graph.nodes) / min(speeds.values())
