"""Random optimizer problems shared by the optimizer test modules (bounds, cells, relaxation, flattened,
inner rows): each is deterministic in its seed, so a failing seed reproduces."""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.tuning import Tuning
from model_parallel.optimizer.partition import solve
from model_parallel.optimizer.search import searched_partition as partition  # the search layers' entry
from model_parallel.optimizer.antichains import enumerate_antichains
from model_parallel.optimizer.states import cut_costs, cut_states, preprocess, prefix_states

HIERARCHIES = [([3], [1e9]), ([2, 2], [40e9, 1e9]), ([3, 2], [40e9, 2e9]), ([2, 2, 2], [40e9, 10e9, 1e9])]


def problem(seed: int):
    """A small random graph (branches, residual or DAG), one of HIERARCHIES, random options and memory."""
    rng = random.Random(seed)
    graph = [
        synthetic.branches(rng.randint(2, 4), width=3, depth=2, seed=seed),
        synthetic.residual(rng.randint(3, 8), 2, seed=seed),
        synthetic.random_dag(rng.randint(15, 30), seed=seed, max_fan_in=3),
    ][seed % 3]
    machines, bandwidths = HIERARCHIES[seed % len(HIERARCHIES)]
    options = PartitionOptions(
        straight_pipeline=rng.random() < 0.25,
        use_fewer_machines=rng.random() < 0.3,
        activation_compression_ratio=rng.choice([None, 1.0]),
        use_memory_constraint=rng.random() < 0.25,
        memory_model=rng.choice(["pipedream", "1f1b"]),
    )
    memory = rng.choice([2e8, 6e8, 2e9])
    return graph, Hierarchy.from_lists(machines, bandwidths, memory_bytes=memory), options


def union_states(work, antichains):
    """Every state the bounded solve may keep: the prefixes and the antichains' downsets."""
    return cut_states(work, list(prefix_states(work).members) + antichains.downsets(), "bounded")


def exact_and_unproven(**changes):
    """A three-level problem solved exactly, then again under a budget no exact solve fits and without the
    flattened search's proof (with `changes` to that tuning): (graph, hierarchy, those options, exact
    plan, unproven plan)."""
    graph = synthetic.branches(10, width=4, depth=3, seed=5)
    hierarchy = Hierarchy.from_lists([4, 2, 2], [40e9, 10e9, 1.25e9])
    options = PartitionOptions(activation_compression_ratio=1.0)
    exact = partition(graph, hierarchy, options)
    assert exact.extra["exact"] is True
    options = replace(options, tuning=Tuning(**{"work_budget": 2e4, "quick_cut_points": 12, "flat_proof_passes": 0, **changes}))
    plan = partition(graph, hierarchy, options)
    assert plan.extra["exact"] is False
    return graph, hierarchy, options, exact, plan


def three_level_problem(seed: int):
    """Small graphs on three levels where a server holds few nodes per GPU (its granularity matters)."""
    rng = np.random.default_rng(seed)
    graph = [
        synthetic.branches(int(rng.integers(2, 5)), width=3, depth=2, seed=seed),
        synthetic.residual(int(rng.integers(3, 7)), 2, seed=seed),
        synthetic.chain(int(rng.integers(6, 14)), seed=seed),
    ][seed % 3]
    machines = [int(rng.integers(2, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 3))]
    bandwidths = [float(b) for b in rng.choice([1e8, 1e9, 1e10], size=3)]
    options = PartitionOptions(activation_compression_ratio=[None, 1.0][seed % 2], straight_pipeline=seed % 7 == 0,
                               use_fewer_machines=seed % 5 == 0)
    work = preprocess(graph)
    downsets = list(prefix_states(work).members) + enumerate_antichains(work).downsets()
    hierarchy = Hierarchy.from_lists(machines, bandwidths)
    optimum = solve(cut_states(work, downsets, "bounded"), hierarchy, options).time_s
    return cut_costs(work, downsets), hierarchy, options, optimum, work
