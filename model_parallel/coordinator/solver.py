"""Plan solvers for the policy: `default_solver` (the optimizer's contiguous partitioner with worker
speeds), `memory_solver` (the same under a memory cap: no re-plan moves a rank past its memory) and
`plan_for_workers` for ctl scale.

A solver maps (graph, ranks in stage order, speeds in the same order) to a Plan whose stage k runs on
ranks[k]; the policy calls it with the graph's times already calibrated to this machine. Ranks that repeat
in a loop (interleaved: stage k on rank k % p) get a loop plan that balances each rank's summed stages
(optimizer/loop.py), not each stage.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Callable, Optional

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.contiguous import straight_plan
from model_parallel.optimizer.loop import is_loop, loop_rank_plan
from model_parallel.optimizer.memory import Footprint, MemoryLimit

# solver(graph, ranks in stage order, speeds in the same order) -> Plan (ranks filled in)
Solver = Callable[[Graph, Sequence[int], Sequence[float]], Plan]


def plan_for_workers(graph: Graph, ranks: Sequence[int], speeds: Sequence[float], version: int,
                     solver: Optional[Solver] = None) -> Plan:
    """A plan on exactly `ranks` (stage k on ranks[k]) for the given speeds: used by `scale`."""
    if not ranks:
        raise PlanError("a plan needs at least one worker; scale --workers K with K >= 1")
    return replace((solver or default_solver)(graph, list(ranks), list(speeds)), version=version)


def default_solver(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """The optimizer's one contiguous partitioner (straight fast path) with these speeds: stage k on ranks[k]; a
    loop placement (interleaved) minimises the slowest rank's summed stages instead."""
    if is_loop(ranks):
        return loop_rank_plan(graph, _single_replica_loop(ranks), speeds)
    return straight_plan(graph, ranks, speeds)


def _single_replica_loop(ranks: Sequence[int]) -> Sequence[int]:
    """`ranks` when they are one replica's loop (stage k on rank k % p); a replicated loop plan's ranks (replica i
    on k % p + i*p, listed stage by stage) would re-plan as one wider loop the workers refuse: a PlanError."""
    width = len(set(ranks))
    if list(ranks[:width]) != list(range(width)):
        raise PlanError(f"the policy does not re-plan a replicated interleaved plan (ranks {list(ranks)[:8]} ...): it keeps "
                        "the live plan; give a new one with ctl set-plan")
    return ranks


def memory_solver(memory_per_worker: float, footprint: Footprint) -> Solver:
    """`default_solver` that only returns plans whose every stage's predicted footprint fits
    `memory_per_worker`; when none does on these workers, a PlanError (the policy keeps the live plan)."""
    def solve(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
        try:
            if is_loop(ranks):  # a rank holds several stages: their summed footprint must fit
                plan = loop_rank_plan(graph, _single_replica_loop(ranks), speeds)
                MemoryLimit(memory_per_worker, replace(footprint, schedule="interleaved")).check(graph, plan, "the re-plan")
                return plan
            return straight_plan(graph, ranks, speeds, memory_per_worker, footprint)
        except InfeasibleError as error:
            raise PlanError(f"no re-plan on {len(set(ranks))} worker(s) fits their memory: {error}") from None
    return solve
