"""The relaxed lower bound (optimizer/relaxation.py): never above the optimum, tight where the
relaxation is the problem itself, and reported by `partition` for plans it cannot prove optimal."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from model_parallel.graph.core import Node
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search import searched_partition as partition  # the search layers' entry
from model_parallel.optimizer.search.bounded import cut_union, relaxed_bound
from model_parallel.optimizer.search.relaxation import covers, node_share_bound, relaxed_lower_bound
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.tuning import Tuning
from model_parallel.optimizer.antichains import enumerate_antichains
from model_parallel.optimizer.states import cut_costs, preprocess, prefix_states
from support import first_fast
from support.optimizer import exact_and_unproven, problem, union_states


def two_node_chain(first: Node, second: Node):
    """Input -> first -> second, with the given costs."""
    return synthetic.chain(2).replace_nodes([Node("input0", "Input0"), first, second])


def union_costs(work, antichains):
    return cut_costs(work, list(prefix_states(work).members) + antichains.downsets())


@pytest.mark.parametrize("block", first_fast(4))
def test_relaxation_never_exceeds_the_optimum(block):
    checked = 0
    for seed in range(block * 12, block * 12 + 12):
        graph, hierarchy, options = problem(seed)
        work = preprocess(graph)
        antichains = enumerate_antichains(work)
        optimum = solve(union_states(work, antichains), hierarchy, options).time_s
        if not math.isfinite(optimum):
            continue
        checked += 1
        costs = union_costs(work, antichains)
        # The optimal plan is a plan of the relaxation; from a loose start the bound stays below it.
        assert covers(costs, hierarchy, options, optimum) is True, seed
        lower = relaxed_lower_bound(costs, hierarchy, options, 3 * optimum)
        balance = costs.compute[-1] / hierarchy.num_workers
        assert balance <= lower <= optimum * (1 + 1e-9), seed
        # No budget: every check is skipped as if feasible, leaving perfect balance.
        assert relaxed_lower_bound(costs, hierarchy, options, 3 * optimum, budget=0) == balance
        nodes = node_share_bound(np.array(work.compute_s), np.array(work.parameters), hierarchy, options.straight_pipeline)
        assert balance * (1 - 1e-12) <= nodes <= optimum * (1 + 1e-9), seed
    assert checked >= 8


@pytest.mark.parametrize("seed", range(8))
def test_relaxation_is_tight_on_one_level_without_weights(seed):
    # One level, no weights to all-reduce, idle machines allowed: the relaxation is the DP itself, so
    # the bound lands within the bisection's tolerance below the optimum.
    graph, _, _ = problem(seed)
    graph = graph.replace_nodes([
        Node(n.node_id, n.description, n.forward_ms, n.backward_ms, n.activation_size, 0.0) for n in graph.nodes
    ])
    hierarchy = Hierarchy.from_lists([3 + seed % 3], [1e9])
    options = PartitionOptions(use_fewer_machines=True, activation_compression_ratio=1.0)
    work = preprocess(graph)
    antichains = enumerate_antichains(work)
    optimum = solve(union_states(work, antichains), hierarchy, options).time_s
    lower = relaxed_lower_bound(union_costs(work, antichains), hierarchy, options, 3 * optimum, tolerance=1e-4)
    assert optimum / (1 + 1e-4) * (1 - 1e-9) <= lower <= optimum * (1 + 1e-9)


def test_covers_counts_replicas_transfers_and_machines():
    # A chain Input -> a -> b, each 3 ms of compute (forward + backward), 1 MB out, no weights: one level
    # of 2 machines at 1e9 B/s with transfers counted (R = 1).
    work = preprocess(two_node_chain(Node("node1", "Linear", 1.0, 2.0, 1e6, 0.0), Node("node2", "Linear", 1.0, 2.0, 1e6, 0.0)))
    costs = union_costs(work, enumerate_antichains(work))
    options = PartitionOptions(activation_compression_ratio=1.0)
    two = Hierarchy.from_lists([2], [1e9])
    # Both nodes on 2 replicas: 6 ms / 2 = 3 ms; split: 3 ms each, transfer 2 * 1e6 / 1e9 = 2 ms.
    assert covers(costs, two, options, 3e-3) is True
    assert covers(costs, two, options, 2.99e-3) is False
    # Straight pipeline: only the split, still 3 ms.
    assert covers(costs, two, PartitionOptions(straight_pipeline=True, activation_compression_ratio=1.0), 3e-3)
    # A slow link: the split's transfer takes 2e6 / 4e8 = 5 ms, replication alone still gives 3 ms.
    slow = Hierarchy.from_lists([2], [4e8])
    assert covers(costs, slow, options, 3e-3) is True
    assert covers(costs, slow, PartitionOptions(straight_pipeline=True, activation_compression_ratio=1.0), 4.9e-3) is False
    # Two levels of 2: each outer machine is worth 2 workers at perfect balance, 6 ms / 4 = 1.5 ms.
    assert covers(costs, Hierarchy.from_lists([2, 2], [1e9, 1e9]), PartitionOptions(), 1.5e-3) is True
    assert covers(costs, Hierarchy.from_lists([2, 2], [1e9, 1e9]), PartitionOptions(), 1.49e-3) is False


def test_covers_follows_pipedreams_transfer_and_allreduce_terms():
    # a (3 ms, 1 MB of weights, 2 MB out) -> b (6 ms, no weights) on 3 machines at 1e9 B/s: a alone on one
    # machine, b on two. PipeDream counts the transfer on the receiving stage only (2 * 2e6 / 1e9 / 2 =
    # 2 ms), not a's 4 ms outgoing on one machine: 3 ms, and the DP agrees.
    graph = two_node_chain(Node("node1", "Linear", 1.0, 2.0, 2e6, 1e6), Node("node2", "Linear", 2.0, 4.0, 1e6, 0.0))
    work = preprocess(graph)
    antichains = enumerate_antichains(work)
    costs = union_costs(work, antichains)
    options = PartitionOptions(activation_compression_ratio=1.0)
    three = Hierarchy.from_lists([3], [1e9])
    assert solve(union_states(work, antichains), three, options).time_s == pytest.approx(3e-3, rel=1e-12)
    assert covers(costs, three, options, 3e-3) is True
    # Below 3 ms a needs two replicas ((3 + 4 * 1e6 / 1e9 / 2) / 2 = 2.5 ms) and b three.
    assert covers(costs, three, options, 2.99e-3) is False
    # Two levels of 2 at the top all-reduce divided by the 2 machines inside (PipeDream): a replicated
    # on both outer machines takes (3 / 2 + 4 * 1e6 / (1e9 * 2) / 2) / 2 = 1.25 ms at perfect balance.
    one = synthetic.chain(1).replace_nodes([Node("input0", "Input0"), Node("node1", "Linear", 1.0, 2.0, 2e6, 1e6)])
    work = preprocess(one)
    costs = union_costs(work, enumerate_antichains(work))
    nested = Hierarchy.from_lists([2, 2], [1e9, 1e9])
    assert covers(costs, nested, PartitionOptions(), 1.25e-3) is True
    assert covers(costs, nested, PartitionOptions(), 1.24e-3) is False


def test_node_share_bound_is_the_replicated_node_time():
    # One node, 4 ms and 1 MB of weights, on 2 machines at 1e9 B/s: alone it takes 4 ms; on both,
    # (4 + 4 * 1e6 / (1e9 * 2)) / 2 = 3 ms, which is also the best plan.
    compute, parameters = np.array([4e-3]), np.array([1e6])
    two = Hierarchy.from_lists([2], [1e9])
    assert node_share_bound(compute, parameters, two, tolerance=1e-9) == pytest.approx(3e-3, rel=1e-8)
    graph = synthetic.chain(1).replace_nodes([Node("input0", "Input0"), Node("node1", "Linear", 1.0, 3.0, 1e6, 1e6)])
    assert partition(graph, two).time_per_minibatch_s == pytest.approx(3e-3, rel=1e-12)
    # A straight pipeline cannot replicate: the node's own 4 ms.
    assert node_share_bound(compute, parameters, two, straight_pipeline=True, tolerance=1e-9) == pytest.approx(4e-3, rel=1e-8)
    # Two such nodes on 2 machines of 2 workers, every link 1e9 B/s: perfect balance says 2 ms. The
    # cheapest replication for a node is one worker in each outer machine (PipeDream divides the outer
    # all-reduce by the 2 machines inside): 4 / 2 + 4 * 1e6 / (1e9 * 2 * 2) / 2 = 2.5 ms, and a node
    # then holds 4 / (T - 0.5 ms) workers: both fit in 4 from T = 2.5 ms. (The best plan takes 3 ms.)
    nested = Hierarchy.from_lists([2, 2], [1e9, 1e9])
    bound = node_share_bound(np.array([4e-3, 4e-3]), np.array([1e6, 1e6]), nested, tolerance=1e-9)
    assert bound == pytest.approx(2.5e-3, rel=1e-8)
    pair = synthetic.chain(2).replace_nodes([
        Node("input0", "Input0"), Node("node1", "Linear", 1.0, 3.0, 1e6, 1e6), Node("node2", "Linear", 1.0, 3.0, 1e6, 1e6),
    ])
    assert partition(pair, nested).time_per_minibatch_s == pytest.approx(3e-3, rel=1e-12)


def test_unproven_plan_reports_the_relaxed_bound():
    # The plan is the best over a few prefixes (without the flattened search, which would bound it
    # more tightly: test_optimizer_flattened.py).
    graph, hierarchy, options, exact, plan = exact_and_unproven(max_flat_states=0)
    balance = plan.single_machine_time_s / hierarchy.num_workers
    assert balance < plan.extra["lower_bound_s"] <= exact.time_per_minibatch_s * (1 + 1e-9)
    work = preprocess(graph)
    relaxed = relaxed_bound(work, hierarchy, options, cut_union(work, enumerate_antichains(work)), plan.time_per_minibatch_s)
    nodes = node_share_bound(np.array(work.compute_s), np.array(work.parameters), hierarchy)
    assert plan.extra["lower_bound_s"] == pytest.approx(max(relaxed, nodes), rel=1e-12)
