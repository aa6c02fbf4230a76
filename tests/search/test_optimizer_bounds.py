"""Bounded solves are exact: the DP over the states `bounds.py` keeps equals the DP over all of them."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer import partition as partition_module
from model_parallel.optimizer.search import searched_partition
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search import bounded as bounded_module
from model_parallel.optimizer.search.bounded import bounded_solve, cut_union, solve_bounded
from model_parallel.optimizer.search.bounds import boundary_states, level_bounds
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.tuning import Tuning
from model_parallel.optimizer.antichains import antichain_states, enumerate_antichains
from model_parallel.optimizer.states import cut_states, preprocess, prefix_states
from support import first_fast
from support.optimizer import HIERARCHIES, problem, union_states


@pytest.mark.parametrize("over_cells", [False, True])
@pytest.mark.parametrize("block", first_fast(6))
def test_bounded_solve_equals_the_full_dp(block, over_cells):
    """Through `bounded_solve` (states kept by the bound, and with cells those some cell uses)."""
    checked = 0
    for seed in range(block * 10, block * 10 + 10):
        graph, hierarchy, options = problem(seed)
        if over_cells:
            options = replace(options, tuning=Tuning(cell_min_work=0.0, cell_gain=0.0))
        work = preprocess(graph)
        antichains = enumerate_antichains(work)
        full = solve(union_states(work, antichains), hierarchy, options)
        if not math.isfinite(full.time_s):
            continue
        checked += 1
        # Bounds from a loose plan (coarse prefixes) and from the optimum itself (the tightest: every
        # state of the optimal plan sits right at its bound).
        loose = solve(prefix_states(work, 4 + seed % 5), hierarchy, options).time_s
        for upper in {loose if math.isfinite(loose) else 2 * full.time_s, full.time_s}:
            bounded = bounded_solve(work, hierarchy, options, cut_union(work, antichains), upper)
            assert bounded is not None and bounded.exact
            assert bounded.time_s == pytest.approx(full.time_s, rel=1e-12, abs=0), (seed, upper)
            assert bounded.states.num_states <= full.states.num_states
    assert checked >= 5


@pytest.mark.slow
def test_bounded_plan_is_never_worse_than_pipedreams_states():
    graph = synthetic.branches(8, width=4, depth=3, seed=3)
    work = preprocess(graph)
    antichains = enumerate_antichains(work)
    hierarchy = Hierarchy.from_lists([4, 2], [40e9, 1.25e9])
    options = PartitionOptions(activation_compression_ratio=1.0)
    from model_parallel.optimizer.antichains import finish_antichains
    pipedream_states = finish_antichains(work, antichains)
    strict = solve(cut_states(work, list(pipedream_states.members), "bounded"), hierarchy, options)
    upper = solve(prefix_states(work, 12), hierarchy, options).time_s
    bounded = bounded_solve(work, hierarchy, options, cut_union(work, antichains), upper)
    assert bounded.time_s <= strict.time_s * (1 + 1e-12)
    assert bounded.time_s <= upper * (1 + 1e-12)


def test_boundary_states_keep_exactly_the_feasible_worker_counts():
    compute = np.array([1.0, 2.0, 2.5, 3.0, 4.0])
    # T = 1, 4 workers, total 4: a boundary needs C(j) <= m and 4 - C(j) <= 4 - m for some m in 1..3,
    # i.e. C(j) is an integer 1..3 (within rounding).
    assert boundary_states(compute, 4.0, 4, 1, 1.0).tolist() == [True, True, False, True, False]
    # Groups of 2 workers: only m = 2.
    assert boundary_states(compute, 4.0, 4, 2, 1.0).tolist() == [False, True, False, False, False]
    # A looser bound keeps more.
    assert boundary_states(compute, 4.0, 4, 1, 1.25).sum() == 4
    output = np.array([0.0, 0.0, 0.0, 5.0, 0.0])
    bounds = level_bounds(compute, output, Hierarchy.from_lists([2, 2], [1e9, 1e9]), 1.0, None)
    assert bounds.splittable[0].tolist() == [True, True, False, True, False]
    assert bounds.starts[0].tolist() == [False, True, False, False, False]
    assert not bounds.starts[1].any()
    # Transfers counted: a split at level 0 (B = 4, 2 machines, 2 outside) allows O <= 1 * 4 * 1 * 2 / 2 = 4.
    counted = level_bounds(compute, output, Hierarchy.from_lists([2, 2], [4.0, 4.0]), 1.0, 1.0)
    assert counted.splittable[0].tolist() == [True, True, False, False, False]
    assert counted.kept_states().tolist() == [True, True, False, False, True]


@pytest.mark.slow
@pytest.mark.parametrize("block", range(3))
def test_bounded_pipedream_dp_equals_pipedreams_dp(block):
    """PipeDream's own states, not-a-range entries included: the bounded DP gives the same time and plan."""
    checked = 0
    for seed in range(block * 12, block * 12 + 12):
        graph, _, options = problem(seed)
        machines, bandwidths = HIERARCHIES[1 + seed % (len(HIERARCHIES) - 1)]  # hierarchies only
        hierarchy = Hierarchy.from_lists(machines, bandwidths, memory_bytes=[2e8, 6e8, 2e9][seed % 3])
        work = preprocess(graph)
        states = antichain_states(work)
        full = solve(states, hierarchy, options)
        if not math.isfinite(full.time_s):
            continue
        checked += 1
        loose = solve(prefix_states(work, 4 + seed % 5), hierarchy, options).time_s
        for upper in {loose if math.isfinite(loose) else 2 * full.time_s, full.time_s}:
            bounds = level_bounds(states.compute, states.output, hierarchy, upper, options.activation_compression_ratio)
            bounded = solve_bounded(states, hierarchy, options, bounds)
            assert bounded.time_s == full.time_s, (seed, upper)
            assert (bounded.parts, bounded.level_replicas, bounded.part_ranks) == (full.parts, full.level_replicas, full.part_ranks)
    assert checked >= 6


@pytest.mark.slow
def test_auto_prunes_pipedreams_dp_without_changing_the_plan(monkeypatch):
    bounded_calls = []
    real_solve = bounded_module.solve_bounded

    def counting_solve(states, hierarchy, options, bounds):
        bounded_calls.append(states.kind == "antichain")
        return real_solve(states, hierarchy, options, bounds)

    monkeypatch.setattr(bounded_module, "solve_bounded", counting_solve)
    graph = synthetic.branches(8, width=4, depth=3, seed=3)
    hierarchy = Hierarchy.from_lists([4, 2], [40e9, 1.25e9])
    options = PartitionOptions(activation_compression_ratio=1.0, tuning=Tuning(prune_min_work=0.0))
    auto = searched_partition(graph, hierarchy, options)
    assert any(bounded_calls) and auto.extra["cuts"] == "antichain" and auto.extra["exact"]
    reference = partition_module.partition(graph, hierarchy, PartitionOptions(activation_compression_ratio=1.0, cuts="antichain"))
    assert auto.time_per_minibatch_s == reference.time_per_minibatch_s
    assert [s.node_ids for s in auto.stages] == [s.node_ids for s in reference.stages]
    assert [s.ranks for s in auto.stages] == [s.ranks for s in reference.stages]


@pytest.mark.slow
def test_a_bound_below_pipedreams_optimum_falls_back_to_the_full_dp(monkeypatch):
    """A prefix plan can beat every antichain plan (a cut PipeDream misses); then no antichain plan is
    within its time and the full DP must run. Simulated by a quick plan that claims half its time."""
    real_solve = bounded_module.solve

    def optimistic_prefixes(states, hierarchy, options, limits=None):
        solution = real_solve(states, hierarchy, options, limits)
        return replace(solution, time_s=solution.time_s / 2) if states.kind.startswith("topological") else solution

    monkeypatch.setattr(bounded_module, "solve", optimistic_prefixes)
    graph = synthetic.branches(8, width=4, depth=3, seed=3)
    work = preprocess(graph)
    states = antichain_states(work)
    hierarchy = Hierarchy.from_lists([4, 2], [40e9, 1.25e9])
    options = PartitionOptions(activation_compression_ratio=1.0, tuning=Tuning(prune_min_work=0.0))
    got = bounded_module.solve_antichains(work, states, hierarchy, options)
    assert got.time_s == real_solve(states, hierarchy, options).time_s


@pytest.mark.slow
def test_a_bounded_solve_below_the_best_time_is_exact_or_proves_a_lower_bound():
    """`solve_below` with budgets forcing its bounds below the known plan's time: when a bound
    reaches the optimum it returns the optimum, marked exact; when not, every plan takes more than the
    bound it reports as `lower_bound_s`, and the plan it returns is a real one (never below the optimum)."""
    from model_parallel.optimizer.search.bounded import estimated_bounded_work, solve_below

    outcomes = set()
    for seed in range(60):
        graph, hierarchy, options = problem(seed)
        work = preprocess(graph)
        antichains = enumerate_antichains(work)
        optimum = solve(union_states(work, antichains), hierarchy, options).time_s
        upper = solve(prefix_states(work, 3), hierarchy, options)
        union = cut_union(work, antichains)
        lower = float(union.compute.max()) / hierarchy.num_workers
        if not (math.isfinite(upper.time_s) and upper.time_s > optimum * (1 + 1e-6) and lower < optimum):
            continue
        # Budgets that reach a time between the lower bound and the optimum, or just past the optimum
        # (a first, smaller one proves a weaker lower bound on the way).
        target = [lower + (optimum - lower) / 2, optimum * (1 + 1e-7)][seed % 2]
        budgets = tuple(estimated_bounded_work(union, hierarchy, options, t, with_inclusion=True)
                        for t in (lower + (target - lower) / 4, target))
        got = solve_below(work, hierarchy, replace(options, tuning=Tuning(below_budgets=budgets)), union, upper, lower)
        if got.exact:
            outcomes.add("exact")
            assert got.time_s == pytest.approx(optimum, rel=1e-12, abs=0), seed
            assert got.states.kind == "bounded"
        else:
            assert got.lower_bound_s is not None and lower <= got.lower_bound_s <= optimum * (1 + 1e-9), seed
            assert optimum * (1 - 1e-12) <= got.time_s <= upper.time_s * (1 + 1e-12), seed
            outcomes.add("bounded below" if got.lower_bound_s > lower else "unchanged")
    assert {"exact", "bounded below"} <= outcomes, outcomes


def test_the_work_estimate_matches_the_bounded_problem_without_transfers():
    """auto skips the crossing bytes of every cut when the estimate says a bounded solve is too big:
    from compute alone (states in compute order, not size order) it must stay within a factor 2 of the
    real count (transfers, when counted, only prune more)."""
    from model_parallel.optimizer.search.bounds import bounded_work
    from model_parallel.optimizer.search.bounded import estimated_bounded_work

    for seed in range(12):
        graph, hierarchy, _ = problem(seed)
        options = PartitionOptions()
        work = preprocess(graph)
        union = cut_union(work, enumerate_antichains(work))
        optimum = solve(union_states(work, enumerate_antichains(work)), hierarchy, options).time_s
        for factor in (1.0, 1.05, 1.3):
            # What bounded_solve counts: the cuts that pass the compute test, with their real costs.
            maybe = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, 1, optimum * factor)
            costs = union.costs(work, maybe)
            bounds = level_bounds(costs.compute, costs.output, hierarchy, optimum * factor, None)
            real = bounded_work(bounds.restricted(bounds.kept_states()), hierarchy, options.straight_pipeline)
            # auto skips the exact solve when the estimate exceeds twice the budget: it must never say more.
            estimate = estimated_bounded_work(union, hierarchy, options, optimum * factor)
            assert real / 2 <= estimate <= 2 * real, (seed, factor, estimate, real)
