"""Optimality: the DP against exhaustive search over every partition of small random DAGs (seeded loops)."""
from __future__ import annotations

import math
import random

import pytest

from model_parallel.graph.core import Graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.errors import InfeasibleError
from model_parallel.optimizer.brute_force import all_cuts, brute_force, brute_force_hierarchy, chains_of
from model_parallel.optimizer.costs import predict_stage_times
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.antichains import antichain_states
from model_parallel.optimizer.states import preprocess, prefix_states
from support import first_fast


def small_graph(seed: int) -> Graph:
    """Chains, residual blocks, wide branches and random DAGs of at most ~12 nodes."""
    rng = random.Random(seed)
    kind = seed % 4
    if kind == 0:
        return synthetic.chain(rng.randint(2, 8), seed=seed)
    if kind == 1:
        return synthetic.residual(rng.randint(1, 3), rng.randint(1, 2), seed=seed)
    if kind == 2:
        return synthetic.branches(rng.randint(1, 2), width=rng.randint(2, 3), depth=2, seed=seed)
    return synthetic.random_dag(rng.randint(3, 9), seed=seed, max_fan_in=3)


def random_problem(seed: int) -> tuple[Graph, int, float, dict]:
    rng = random.Random(1000 + seed)
    options = dict(
        straight_pipeline=rng.random() < 0.3,
        use_fewer_machines=rng.random() < 0.3,
        activation_compression_ratio=rng.choice([None, 1.0, 3.0]),
    )
    return small_graph(seed), rng.randint(1, 5), rng.choice([1e9, 2e10]), options


def _time(graph, machines, bandwidth, options, memory=16e9) -> float:
    try:
        return partition(graph, Hierarchy.from_lists([machines], [bandwidth], memory), PartitionOptions(**options)).time_per_minibatch_s
    except Exception as error:  # infeasible: compare as inf
        assert "InfeasibleError" in type(error).__name__, error
        return math.inf


def _same(a: float, b: float) -> bool:
    return a == b == math.inf or math.isclose(a, b, rel_tol=1e-9)


@pytest.mark.parametrize("block", first_fast(4))
def test_dp_equals_brute_force(block):
    for seed in range(block * 25, block * 25 + 25):
        graph, machines, bandwidth, options = random_problem(seed)
        work = preprocess(graph)
        args = (machines, bandwidth, options["activation_compression_ratio"], options["straight_pipeline"],
                options["use_fewer_machines"])
        # Reproduce mode: exhaustive over chains of PipeDream's own states.
        pipedream = _time(graph, machines, bandwidth, {**options, "cuts": "antichain"})
        oracle, _ = brute_force(*chains_of(antichain_states(work)), *args)
        assert _same(pipedream, oracle), (seed, machines, options, pipedream, oracle)
        # Extended mode: exhaustive over every downward-closed cut (found by testing all subsets).
        extended = _time(graph, machines, bandwidth, {**options, "cuts": "all"})
        oracle_all, chain = brute_force(*all_cuts(work), *args)
        assert _same(extended, oracle_all), (seed, machines, options, extended, oracle_all)
        assert extended <= pipedream * (1 + 1e-12), (seed, extended, pipedream)


def test_memory_constraint_matches_brute_force():
    for seed in range(30):
        graph, machines, bandwidth, options = random_problem(seed)
        options["use_fewer_machines"] = False
        work = preprocess(graph)
        total = sum(work.activation) + sum(work.parameters)
        for model in ("pipedream", "1f1b"):
            limit = total * random.Random(seed).choice([0.3, 0.6, 1.5])
            opts = {**options, "use_memory_constraint": True, "memory_model": model, "cuts": "all"}
            got = _time(graph, machines, bandwidth, opts, memory=limit)
            oracle, _ = brute_force(*all_cuts(work), machines, bandwidth, options["activation_compression_ratio"],
                                    options["straight_pipeline"], False, limit, model)
            assert _same(got, oracle), (seed, model, got, oracle)
            # the straight fast path (prefix cuts) applies the same memory rule
            straight = {**opts, "cuts": "topological", "straight_pipeline": True}
            got = _time(graph, machines, bandwidth, straight, memory=limit)
            oracle, _ = brute_force(*chains_of(prefix_states(work)), machines, bandwidth,
                                    options["activation_compression_ratio"], True, False, limit, model)
            assert _same(got, oracle), (seed, model, "fast path", got, oracle)


def test_straight_fast_path_with_speeds_matches_brute_force():
    for seed in range(40):
        rng = random.Random(seed)
        graph = small_graph(seed)
        work = preprocess(graph)
        workers = rng.randint(1, min(4, work.num_nodes))
        speeds = tuple(rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(workers))
        ratio = rng.choice([None, 1.0])
        options = PartitionOptions(straight_pipeline=True, worker_speeds=speeds, activation_compression_ratio=ratio)
        plan = partition(graph, Hierarchy.from_lists([workers]), options)
        oracle, _ = brute_force(*chains_of(prefix_states(work)), workers, 1e9, ratio, True, False, worker_speeds=speeds)
        assert _same(plan.time_per_minibatch_s, oracle), (seed, plan.time_per_minibatch_s, oracle)
        assert max(predict_stage_times(graph, plan, speeds, activation_compression_ratio=ratio)) == pytest.approx(
            plan.time_per_minibatch_s, rel=1e-9)


def test_replicated_stages_with_speeds_match_brute_force():
    checked = 0
    for seed in range(40):
        rng = random.Random(500 + seed)
        graph = small_graph(seed)
        work = preprocess(graph)
        workers = rng.randint(2, 5)
        speeds = tuple(rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(workers))
        ratio = rng.choice([None, 1.0])
        bandwidth = rng.choice([1e9, 2e10])
        options = PartitionOptions(worker_speeds=speeds, activation_compression_ratio=ratio)
        plan = partition(graph, Hierarchy.from_lists([workers], [bandwidth]), options)
        oracle, _ = brute_force(*chains_of(prefix_states(work)), workers, bandwidth, ratio, False, False, worker_speeds=speeds)
        assert _same(plan.time_per_minibatch_s, oracle), (seed, plan.time_per_minibatch_s, oracle)
        predicted = predict_stage_times(graph, plan, speeds, bandwidth=bandwidth, activation_compression_ratio=ratio)
        if ratio is None:
            assert max(predicted) == pytest.approx(plan.time_per_minibatch_s, rel=1e-9)
        else:  # PipeDream's DP skips the first stage's output transfer; the prediction counts it
            assert max(predicted) >= plan.time_per_minibatch_s * (1 - 1e-9)
        checked += any(stage.num_replicas > 1 for stage in plan.stages)
    assert checked >= 5, "some plans should replicate a stage"


def pipedream_compute_partitioning(compute_times, activation_sizes, parameter_sizes, output_activation_sizes,
                                   all_predecessor_ids, num_machines, num_machines_within_machine, bandwidth,
                                   final_level, straight_pipeline, use_fewer_machines, ratio):
    """PipeDream's `compute_partitioning` loop for loop (None = no value), as the multi-level oracle."""
    num_rows, num_states = len(compute_times), len(compute_times[0])
    A = [[[(None, None, None)] * num_machines for _ in range(num_states)] for _ in range(num_rows)]
    for i in range(num_rows):
        for j in range(i, num_states):
            for m in range(1 if straight_pipeline else num_machines):
                dp = (4 * m * parameter_sizes[i][j]) / (bandwidth * (m + 1)) / num_machines_within_machine
                if compute_times[i][j] is not None:
                    A[i][j][m] = (sum([compute_times[i][j], dp]) / (m + 1), None, m + 1)
    for i in range(1 if final_level else num_rows):
        for m in range(1, num_machines):
            for j in range(i + 1, num_states):
                best, split, used = A[i][j][m]
                if use_fewer_machines and (best is None or (A[i][j][m - 1][0] is not None and A[i][j][m - 1][0] < best)):
                    best, split, used = A[i][j][m - 1]
                for k in all_predecessor_ids[j]:
                    if i > 0 and k in all_predecessor_ids[i - 1]:
                        continue
                    for mp in range(1, 2 if straight_pipeline else m + 1):
                        inp = (2.0 * output_activation_sizes[k]) / (bandwidth * mp)
                        out = (2.0 * output_activation_sizes[j]) / (bandwidth * mp) if j < num_states - 1 else None
                        last = compute_times[k + 1][j]
                        if last is None or A[i][k][m - mp][0] is None:
                            continue
                        last = sum([last, (4 * (mp - 1) * parameter_sizes[k + 1][j]) / (bandwidth * mp)]) / mp
                        t = max(A[i][k][m - mp][0], last)
                        if ratio is not None:
                            t = max(t, inp / ratio, *([out / ratio] if out is not None else []))
                        if best is None or best > t:
                            best, split, used = t, (k, m - mp), mp
                A[i][j][m] = (best, split, used)
    return A


def pipedream_hierarchical(states, levels, straight_pipeline=False, use_fewer_machines=False, ratio=None):
    s = states.num_states
    x = [float(v) for v in states.compute]

    def table(values):
        return [[values[j] if i == 0 else (values[j] - values[i - 1] if j > i - 1 else None) for j in range(s)]
                for i in range(s + 1)]

    compute, activation, parameters = table(x), table(list(states.activation)), table(list(states.parameters))
    preds = [list(states.pred_ids(j)) for j in range(s)]
    within = 1
    for number, (machines, bandwidth) in enumerate(levels):
        A = pipedream_compute_partitioning(compute, activation, parameters, list(states.output), preds, machines,
                                           within, bandwidth, number == len(levels) - 1, straight_pipeline,
                                           use_fewer_machines, ratio)
        compute = [[A[i][j][-1][0] for j in range(s)] for i in range(s + 1)]
        within = machines
    value = A[0][s - 1][-1][0]
    return math.inf if value is None else value


def test_multi_level_equals_pipedream_loops():
    """Two and three levels on small random DAGs: the vectorised DP equals PipeDream's own loops."""
    for seed in range(24):
        rng = random.Random(2000 + seed)
        graph = small_graph(seed)
        levels = [(rng.randint(1, 3), rng.choice([40e9, 1e9])) for _ in range(rng.choice([2, 2, 3]))]
        options = dict(straight_pipeline=rng.random() < 0.2, use_fewer_machines=rng.random() < 0.3,
                       activation_compression_ratio=rng.choice([None, 1.0]))
        expected = pipedream_hierarchical(antichain_states(preprocess(graph)), levels, options["straight_pipeline"],
                                          options["use_fewer_machines"], options["activation_compression_ratio"])
        hierarchy = Hierarchy.from_lists([m for m, _ in levels], [b for _, b in levels])
        got = _time_h(graph, hierarchy, {**options, "cuts": "antichain"})
        assert _same(got, expected), (seed, levels, options, got, expected)


def _time_h(graph, hierarchy, options) -> float:
    try:
        return partition(graph, hierarchy, PartitionOptions(**options)).time_per_minibatch_s
    except Exception as error:
        assert "InfeasibleError" in type(error).__name__, error
        return math.inf


def _hierarchy_problem(seed: int) -> tuple[Graph, list[int], list[float], dict]:
    rng = random.Random(5000 + seed)
    machines = rng.choice(([2, 2], [3, 2], [2, 3], [2, 2, 2], [1, 3], [3, 1]))
    bandwidths = [rng.choice([2e8, 1e9, 4e10]) for _ in machines]
    # No use_fewer_machines: PipeDream's inner levels never let a one-state range leave machines idle
    # (its loop starts at j = i + 1), a quirk the DP keeps and the model's text does not have.
    options = dict(straight_pipeline=rng.random() < 0.2, activation_compression_ratio=rng.choice([None, 1.0]))
    return small_graph(seed), machines, bandwidths, options


def test_hierarchy_matches_brute_force_over_every_cut():
    # Several levels, each stage's compute its range's best one level down (FORMATS.md step 4), over
    # every valid cut of small DAGs: the DP equals exhaustive search written from the model's text.
    for seed in range(80):
        graph, machines, bandwidths, options = _hierarchy_problem(seed)
        if len(all_cuts(preprocess(graph))[0]) > 40:
            continue
        try:
            got = partition(graph, Hierarchy.from_lists(machines, bandwidths), PartitionOptions(cuts="all", **options))
        except InfeasibleError:
            got = None
        oracle, _ = brute_force_hierarchy(*all_cuts(preprocess(graph)), machines, bandwidths,
                                          options["activation_compression_ratio"], options["straight_pipeline"])
        if got is None:
            assert oracle == math.inf, (seed, machines, options)
        else:
            assert got.time_per_minibatch_s == pytest.approx(oracle, rel=1e-12), (seed, machines, options)


@pytest.mark.slow
def test_worker_speeds_on_a_hierarchy_match_brute_force():
    # A stage on machines a..b of a level runs the inner plan at the slowest of them at every position;
    # the DP over prefixes (what speeds use) equals exhaustive search, and the speeds matter.
    changed = 0
    for seed in range(120):
        graph, machines, bandwidths, options = _hierarchy_problem(seed)
        rng = random.Random(seed)
        speeds = tuple(rng.choice([0.5, 1.0, 1.0, 2.0]) for _ in range(math.prod(machines)))
        memory = rng.choice([None, 2e7])
        hierarchy = Hierarchy.from_lists(machines, bandwidths, memory or 16e9)
        plan_options = PartitionOptions(worker_speeds=speeds, use_memory_constraint=memory is not None, **options)
        try:
            got = partition(graph, hierarchy, plan_options).time_per_minibatch_s
        except InfeasibleError:
            got = math.inf
        oracle, _ = brute_force_hierarchy(*chains_of(prefix_states(preprocess(graph))), machines, bandwidths,
                                          options["activation_compression_ratio"], options["straight_pipeline"],
                                          memory_limit=memory, worker_speeds=speeds)
        assert got == oracle or got == pytest.approx(oracle, rel=1e-12), (seed, machines, speeds, options)
        plain, _ = brute_force_hierarchy(*chains_of(prefix_states(preprocess(graph))), machines, bandwidths,
                                         options["activation_compression_ratio"], options["straight_pipeline"],
                                         memory_limit=memory)
        changed += oracle != plain
    assert changed > 30
