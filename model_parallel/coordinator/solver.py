"""Plan solvers for the policy: `default_solver` (the optimizer's contiguous partitioner with worker
speeds), `memory_solver` (the same under a memory cap: no re-plan moves a rank past its memory) and
`plan_for_workers` for ctl scale.

A solver maps (graph, ranks in stage order, speeds in the same order) to a Plan whose stage k runs on
ranks[k]; the policy calls it with the graph's times already calibrated to this machine. Ranks that repeat
in a loop (interleaved: stage k on rank k % p) or in a V (zbv: rank r holds stages r and 2p-1-r) get a plan of
that placement that balances each rank's summed stages (optimizer/loop.py), not each stage.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Callable, Optional

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.contiguous import straight_plan
from model_parallel.optimizer.loop import is_loop, is_v, loop_rank_plan, v_rank_plan
from model_parallel.graph.in_flight import LOOP_SCHEDULES
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
    loop placement (interleaved) or a V (zbv) minimises the slowest rank's summed stages instead."""
    if len(set(ranks)) < len(ranks):
        return _rank_sum_plan(graph, ranks, speeds)
    return straight_plan(graph, ranks, speeds)


def _rank_sum_plan(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """The loop or V plan of one replica (ranks 0..p-1 first); a replicated plan's ranks (replica i on that rank +
    i*p, listed stage by stage) would re-plan as one wider placement the workers refuse: a PlanError."""
    width = len(set(ranks))
    if list(ranks[:width]) != list(range(width)) or not (is_loop(ranks) or is_v(ranks)):
        raise PlanError(f"the policy does not re-plan a replicated plan with several stages per rank (ranks "
                        f"{list(ranks)[:8]} ...): it keeps the live plan; give a new one with ctl set-plan")
    return (loop_rank_plan if is_loop(ranks) else v_rank_plan)(graph, ranks, speeds)


def memory_solver(memory_per_worker: float, footprint: Footprint) -> Solver:
    """`default_solver` that only returns plans whose every stage's predicted footprint fits
    `memory_per_worker`; when none does on these workers, a PlanError (the policy keeps the live plan)."""
    def solve(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
        try:
            if len(set(ranks)) < len(ranks):  # a rank holds several stages: their summed footprint must fit
                plan = _rank_sum_plan(graph, ranks, speeds)
                # A loop is priced as the job's loop schedule (zbinterleaved holds each microbatch until its W:
                # more than interleaved); one-stage-per-rank or auto footprints price it as interleaved, and under
                # auto the schedule chosen for it is priced again by its own footprint (coordinator/rechoose.py).
                schedule = ("zbv" if plan.is_v_placement else
                            footprint.schedule if footprint.schedule in LOOP_SCHEDULES else "interleaved")
                MemoryLimit(memory_per_worker, replace(footprint, schedule=schedule)).check(graph, plan, "the re-plan")
                return plan
            return straight_plan(graph, ranks, speeds, memory_per_worker, footprint)
        except InfeasibleError as error:
            raise PlanError(f"no re-plan on {len(set(ranks))} worker(s) fits their memory: {error}") from None
    return solve
