"""The flattened pass (optimizer/flattened.py): its relaxation never rejects the optimum and is at least
as tight as `relaxation.covers`; its heuristic plans are real plans within their time; `partition`
uses both where no exact solve fits."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.core import Node
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search import searched_partition as partition  # the search layers' entry
from model_parallel.optimizer.search import flattened as flattened_module
from model_parallel.optimizer.search.bounded import cut_union, relaxed_bound
from model_parallel.optimizer.search.flattened import flat_feasible, flat_plan_cuts, flat_states
from model_parallel.optimizer.search.relaxation import covers, fewest_replicas
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.antichains import enumerate_antichains
from model_parallel.optimizer.states import cut_costs, cut_states, preprocess, prefix_states
from support import first_fast
from support.optimizer import exact_and_unproven, problem, three_level_problem

# Seeds of `problem` with two or three levels (every fourth one has a single level).
HIERARCHICAL = [seed for seed in range(160) if seed % 4]


@pytest.fixture(params=[128, pytest.param(8, marks=pytest.mark.slow)], ids=["one block", "blocks of 8"])
def blocks(request, monkeypatch):
    """A pass reads earlier blocks through windows and its own block in waves: small graphs fit one
    block of the default size, so every test also runs with blocks of 8 states."""
    monkeypatch.setattr(flattened_module, "_BLOCK", request.param)


def union_problem(seed: int):
    graph, hierarchy, options = problem(seed)
    work = preprocess(graph)
    downsets = list(prefix_states(work).members) + enumerate_antichains(work).downsets()
    optimum = solve(cut_states(work, downsets, "bounded"), hierarchy, options).time_s
    return work, downsets, hierarchy, options, optimum


@pytest.mark.parametrize("block", first_fast(4))
def test_relaxation_keeps_the_optimum_and_is_at_least_as_tight_as_covers(block, blocks):
    checked = tighter = 0
    for seed in HIERARCHICAL[block::4]:
        work, downsets, hierarchy, options, optimum = union_problem(seed)
        if not math.isfinite(optimum):
            continue
        checked += 1
        costs = cut_costs(work, downsets)
        states = flat_states(costs, hierarchy, 2 * optimum)
        # The optimal plan is a plan of the relaxation (every option, memory limits ignored).
        assert flat_feasible(states, hierarchy, options, optimum), seed
        for fraction in (0.7, 0.85, 0.95, 1.0, 1.5):
            time_s = fraction * optimum
            flat, coarse = flat_feasible(states, hierarchy, options, time_s), covers(costs, hierarchy, options, time_s)
            assert coarse or not flat, (seed, fraction)  # what the flat relaxation allows, covers allows
            tighter += coarse and not flat
    assert checked >= 25
    assert tighter >= 2  # and it does reject times covers cannot


@pytest.mark.slow
@pytest.mark.parametrize("block", range(2))
def test_heuristic_cuts_give_real_plans_within_their_time(block, blocks):
    found = 0
    for seed in HIERARCHICAL[block::2]:
        work, downsets, hierarchy, options, optimum = union_problem(seed)
        if not math.isfinite(optimum) or options.straight_pipeline:  # partition never asks then
            continue
        states = flat_states(cut_costs(work, downsets), hierarchy, 3 * optimum)
        for fraction in (1.0, 1.5, 3.0):
            cuts = flat_plan_cuts(states, hierarchy, options, fraction * optimum)
            if cuts is None:
                assert fraction < 3.0, seed  # data-parallel inside machines fits three times the optimum here
                continue
            found += 1
            plan = solve(cut_states(work, cuts, "flattened"), hierarchy, options)
            assert optimum * (1 - 1e-9) <= plan.time_s <= fraction * optimum * (1 + 1e-9), (seed, fraction)
    assert found >= 60


def test_a_pass_reads_only_the_states_prepared_for_its_time_and_budget():
    work, downsets, hierarchy, options, optimum = union_problem(1)
    states = flat_states(cut_costs(work, downsets), hierarchy, optimum)
    with pytest.raises(PlanError, match="prepared for at most"):
        flat_feasible(states, hierarchy, options, 1.01 * optimum)
    # Over a budget of state pairs nothing is built (the inclusions cost as much as a pass).
    assert flat_states(cut_costs(work, downsets), hierarchy, optimum, max_pairs=states.pairs) is not None
    assert flat_states(cut_costs(work, downsets), hierarchy, optimum, max_pairs=states.pairs - 1) is None


def test_one_outer_machine_with_all_reduce_bound_and_plan():
    # Two GPUs in one server (the outer level has one machine): a chain of two equal nodes. One per GPU
    # takes 1 ms with transfers off; the relaxation cannot do better (perfect balance), the heuristic
    # finds it (two stages of one GPU), and nothing below it.
    graph = synthetic.chain(2).replace_nodes([
        Node("input0", "Input0"), Node("node1", "Linear", 0.5, 0.5, 2**20, 2**20), Node("node2", "Linear", 0.5, 0.5, 2**20, 2**20),
    ])
    hierarchy = Hierarchy.from_lists([2, 1], [1e9, 1e9])
    options = PartitionOptions()
    work = preprocess(graph)
    states = flat_states(cut_costs(work, list(prefix_states(work).members)), hierarchy, 2e-3)
    assert flat_feasible(states, hierarchy, options, 1e-3)
    assert not flat_feasible(states, hierarchy, options, 0.999e-3)
    cuts = flat_plan_cuts(states, hierarchy, options, 1e-3)
    assert cuts is not None and len(cuts) == 2
    # Data-parallel on both GPUs would take (2 ms + all-reduce 4 * 2 MiB / (1e9 * 2)) / 2 > 1 ms.
    assert flat_plan_cuts(states, hierarchy, options, 0.999e-3) is None


@pytest.mark.slow
def test_unproven_plan_comes_from_the_flattened_search():
    # No exact solve fits: the flattened search gives the plan and the bound.
    graph, hierarchy, options, exact, plan = exact_and_unproven()
    assert plan.extra["cuts"] == "flattened"
    lower = plan.extra["lower_bound_s"]
    assert lower <= exact.time_per_minibatch_s * (1 + 1e-9) <= plan.time_per_minibatch_s * (1 + 2e-9)
    # Tighter than the coarse relaxation the same run would have used without it.
    work = preprocess(graph)
    union = cut_union(work, enumerate_antichains(work))
    coarse = relaxed_bound(work, hierarchy, options, union, plan.time_per_minibatch_s)
    assert lower > coarse


@pytest.mark.slow
def test_the_proof_finds_and_proves_the_optimum_no_exact_solve_fits():
    # The same problem with the proof on: the heuristic's plan, refined by exact inner rows, is the optimum.
    graph, hierarchy, options, exact, _ = exact_and_unproven()
    plan = partition(graph, hierarchy, dataclasses.replace(options, tuning=dataclasses.replace(options.tuning, flat_proof_passes=8)))
    assert plan.extra["cuts"] == "flattened" and plan.extra["exact"] is True
    assert plan.time_per_minibatch_s == pytest.approx(exact.time_per_minibatch_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(16))
def test_relaxation_is_the_problem_when_a_level_has_one_machine(seed, blocks):
    # One GPU per server ([1, M]: every stage is exact, replicated outer ones too) or one server ([M, 1]:
    # one outer stage, its inner stages exact), idle machines allowed (the fewest replicas that fit are
    # a plan): the relaxation is the DP itself, so the bisected bound lands on the optimum. Weights
    # make pipelines beat data parallelism.
    graph, _, _ = problem(seed)
    machines = [1, 2 + seed % 3] if seed % 2 else [2 + seed % 3, 1]
    hierarchy = Hierarchy.from_lists(machines, [1e11, 1e11] if seed % 4 >= 2 else [1e9, 2e9])
    options = PartitionOptions(use_fewer_machines=True, activation_compression_ratio=1.0)
    work = preprocess(graph)
    downsets = list(prefix_states(work).members) + enumerate_antichains(work).downsets()
    optimum = solve(cut_states(work, downsets, "bounded"), hierarchy, options).time_s
    states = flat_states(cut_costs(work, downsets), hierarchy, 2 * optimum)
    low, high = 0.0, 2 * optimum
    while high - low > 1e-6 * optimum:
        middle = (low + high) / 2
        low, high = (low, middle) if flat_feasible(states, hierarchy, options, middle) else (middle, high)
    assert optimum * (1 - 1e-5) <= high <= optimum * (1 + 1e-5)


def test_relaxation_counts_a_replicated_stage_after_an_unreplicated_first_one():
    # Three one-GPU servers. Best plan: node1 alone (1 ms; the first stage counts no transfers), then
    # node2 on two servers (4 ms / 2; its input 2 * 1.5 MB / (1 GB/s * 2) = 1.5 ms): 2 ms. Data
    # parallel would pay node1's all-reduce: (5 ms + 4 * 2 * 1 MB / (1 GB/s * 3)) / 3 = 2.56 ms.
    two_nodes_bound_lands_on_the_optimum(
        Node("node1", "Linear", 0.5, 0.5, 1.5e6, 1e6), Node("node2", "Linear", 2.0, 2.0, 1e6, 0.0),
        Hierarchy.from_lists([1, 3], [1e9, 1e9]), 2e-3)


def two_nodes_bound_lands_on_the_optimum(node1: Node, node2: Node, hierarchy: Hierarchy, optimum_s: float):
    """A chain of two nodes (transfers counted) whose exact optimum is `optimum_s`, where the relaxation's
    bound lands on it: its states and options."""
    graph = synthetic.chain(2).replace_nodes([Node("input0", "Input0"), node1, node2])
    options = PartitionOptions(activation_compression_ratio=1.0)
    work = preprocess(graph)
    downsets = list(prefix_states(work).members)
    assert solve(cut_states(work, downsets, "bounded"), hierarchy, options).time_s == pytest.approx(optimum_s, rel=1e-12)
    states = flat_states(cut_costs(work, downsets), hierarchy, 2 * optimum_s)
    assert flat_feasible(states, hierarchy, options, optimum_s)
    assert not flat_feasible(states, hierarchy, options, 0.995 * optimum_s)
    return states, options


def test_windows_hold_every_stage_that_fits():
    # The weights of a replicated outer stage after the first: its all-reduce alone must fit the limit.
    hierarchy = Hierarchy.from_lists([2, 3, 5], [40e9, 10e9, 1e9])
    most_compute, most_weights = flattened_module._windows(hierarchy, 1e-3)
    weights = np.linspace(0, 2 * most_weights, 2001)
    for replicas in range(2, 6):  # PipeDream's stage time on r replicas, all-reduce not divided (not first)
        fits = 4 * (replicas - 1) * weights / (1e9 * replicas) / replicas <= 1e-3
        assert weights[fits].max() <= most_weights
    assert weights[fits].max() >= 0.999 * most_weights  # on 5 replicas it is the limit
    # A next-level stage inside an unreplicated outer one: at most its 3 machines of 2 workers.
    assert most_compute == pytest.approx(6e-3)
    count = fewest_replicas(np.array([most_compute * 1.001 / 2]), np.zeros(1), np.zeros(1), 1e-3, 3)
    assert not np.isfinite(count).any()


@pytest.mark.slow
@pytest.mark.parametrize("block", range(2))
def test_chains_inside_a_machine_keep_the_optimum_and_tighten_perfect_balance(block, blocks):
    # On three levels the relaxation holds an unreplicated server to chains of its own GPUs: it still
    # admits the optimum, admits nothing perfect balance (no chains) rejects, and rejects more.
    checked = tighter = 0
    for seed in range(block * 40, block * 40 + 40):
        costs, hierarchy, options, optimum, _ = three_level_problem(seed)
        if not math.isfinite(optimum):
            continue
        checked += 1
        states = flat_states(costs, hierarchy, 2 * optimum)
        assert states.inclusion is not None
        balanced = dataclasses.replace(states, inclusion=None)
        assert flat_feasible(states, hierarchy, options, optimum), seed
        for fraction in (0.8, 0.9, 0.95, 0.99):
            chained = flat_feasible(states, hierarchy, options, fraction * optimum)
            assert flat_feasible(balanced, hierarchy, options, fraction * optimum) or not chained, (seed, fraction)
            tighter += not chained and flat_feasible(balanced, hierarchy, options, fraction * optimum)
    assert checked >= 30
    assert tighter >= 5


def test_chains_inside_a_machine_see_that_nodes_do_not_split():
    # One server of two GPUs: node1 (1.5 ms) and node2 (0.5 ms), 10 MB of weights each. Perfect balance
    # says 1 ms; data-parallel pays (2 ms + 4 * 20 MB / (10 GB/s * 2)) / 2 = 3 ms; one node per GPU
    # takes 1.5 ms (node2's input 2 * 1 MiB / 10 GB/s = 0.2 ms; nothing leaves the graph after it),
    # the optimum, and the bound lands on it.
    hierarchy = Hierarchy.from_lists([2, 1, 1], [1e10, 1e9, 1e9])
    states, options = two_nodes_bound_lands_on_the_optimum(
        Node("node1", "Linear", 0.75, 0.75, 2**20, 1e7), Node("node2", "Linear", 0.25, 0.25, 16 * 2**20, 1e7), hierarchy, 1.5e-3)
    assert flat_feasible(dataclasses.replace(states, inclusion=None), hierarchy, options, 1.01e-3)
