"""Plan solvers for the policy: `default_solver` (the optimizer's straight-pipeline fast path) and
`chain_partition` (an exact DP over contiguous cuts), and `plan_for_workers` for ctl scale.

A solver maps (graph, ranks in stage order, speeds in the same order) to a Plan whose stage k runs on
ranks[k]; the policy calls it with the graph's times already calibrated to this machine.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Callable, Optional

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Hierarchy, Plan, StagePlan
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition

logger = logging.getLogger(__name__)

# solver(graph, ranks in stage order, speeds in the same order) -> Plan (ranks filled in)
Solver = Callable[[Graph, Sequence[int], Sequence[float]], Plan]


def plan_for_workers(graph: Graph, ranks: Sequence[int], speeds: Sequence[float], version: int,
                     solver: Optional[Solver] = None) -> Plan:
    """A plan on exactly `ranks` (stage k on ranks[k]) for the given speeds: used by `scale`."""
    if not ranks:
        raise PlanError("a plan needs at least one worker; scale --workers K with K >= 1")
    return replace((solver or default_solver)(graph, list(ranks), list(speeds)), version=version)


def default_solver(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """The optimizer's straight-pipeline fast path with these speeds (`chain_partition` when it cannot
    give every rank one stage)."""
    options = PartitionOptions(straight_pipeline=True, worker_speeds=tuple(float(s) for s in speeds))
    plan = partition(graph, Hierarchy.from_lists([len(ranks)]), options)
    if plan.num_stages != len(ranks) or any(s.num_replicas != 1 for s in plan.stages):
        # Stage k must run on ranks[k]; anything else cannot be placed on these workers.
        logger.warning("optimizer returned %d stage(s) for %d worker(s); using the chain solver", plan.num_stages, len(ranks))
        return chain_partition(graph, ranks, speeds)
    stages = tuple(replace(s, ranks=(int(ranks[i]),)) for i, s in enumerate(plan.stages))
    return replace(plan, stages=stages)


def chain_partition(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """Split the topological order into len(ranks) contiguous stages minimising max(cost_k / speed_k).

    Exact for the bottleneck over contiguous cuts of the fixed topological order (DP, O(p n^2)).
    Model inputs cost nothing and land in stage 0; every stage gets at least one node.
    """
    order = list(graph.topological_order)
    p = len(ranks)
    if p < 1 or p > len(order):
        raise PlanError(f"cannot split {len(order)} node(s) into {p} stage(s)")
    cost = [0.0 if graph[n].is_input else graph[n].compute_ms for n in order]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    n = len(order)
    inf = float("inf")
    # best[k][j]: bottleneck of the first j nodes in k stages; cut[k][j]: start of the k-th stage.
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        speed = max(float(speeds[k - 1]), 1e-9)
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], (prefix[j] - prefix[i]) / speed)
                # strict < keeps the earliest cut on ties: deterministic
                if value < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(p, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    stages = tuple(
        StagePlan(
            stage_id=k,
            node_ids=tuple(order[bounds[k]:bounds[k + 1]]),
            ranks=(int(ranks[k]),),
            compute_s=(prefix[bounds[k + 1]] - prefix[bounds[k]]) / 1e3,
        )
        for k in range(p)
    )
    return Plan(stages=stages, time_per_minibatch_s=best[p][n] / 1e3, single_machine_time_s=prefix[n] / 1e3,
                num_machines=(p,))
