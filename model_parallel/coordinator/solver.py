"""Plan solvers for the policy: `default_solver` (the optimizer's contiguous partitioner with worker
speeds) and `plan_for_workers` for ctl scale.

A solver maps (graph, ranks in stage order, speeds in the same order) to a Plan whose stage k runs on
ranks[k]; the policy calls it with the graph's times already calibrated to this machine.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Callable, Optional

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.contiguous import straight_plan

# solver(graph, ranks in stage order, speeds in the same order) -> Plan (ranks filled in)
Solver = Callable[[Graph, Sequence[int], Sequence[float]], Plan]


def plan_for_workers(graph: Graph, ranks: Sequence[int], speeds: Sequence[float], version: int,
                     solver: Optional[Solver] = None) -> Plan:
    """A plan on exactly `ranks` (stage k on ranks[k]) for the given speeds: used by `scale`."""
    if not ranks:
        raise PlanError("a plan needs at least one worker; scale --workers K with K >= 1")
    return replace((solver or default_solver)(graph, list(ranks), list(speeds)), version=version)


def default_solver(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """The optimizer's one contiguous partitioner (straight fast path) with these speeds: stage k on ranks[k]."""
    return straight_plan(graph, ranks, speeds)
