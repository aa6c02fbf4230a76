"""The rules a plan must pass before any rank runs it: one function for the workers and for the coordinator.

A rank checks a plan when it activates it (the start, a live switch); the coordinator checks a plan
the same way before it issues it (ctl set-plan, scale, rebalance), so a plan the workers would refuse
is refused to the operator instead of ending the job. A rank also checks a switch *before* moving
anything (engine.apply): every rank holds the same graph, plan, world and schedule, so every rank
reaches the same verdict at the same step, and a refused switch leaves the job on its old plan.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from model_parallel.codegen.boundary import StageBoundary, stage_boundaries
from model_parallel.codegen.build import check_shared_modules
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.build.stages import check_plan_fits
from model_parallel.runtime.build.tied import SplitTie, check_schedule, check_trainable, plan_ties
from model_parallel.graph.in_flight import FLUSH_SCHEDULES, MULTI_STAGE_SCHEDULES, V_SCHEDULES


@dataclass(frozen=True)
class CheckedPlan:
    """A plan that passed `check_plan` (ranks assigned), with what the checks computed on the way."""

    plan: Plan
    boundaries: tuple[StageBoundary, ...]
    ties: tuple[SplitTie, ...]


def check_plan(graph: Graph, plan: Plan, world_size: int, schedule: Optional[str],
               modules: Optional[Mapping[str, Any]] = None) -> CheckedPlan:
    """Raise a ModelParallelError naming the first rule `plan` breaks for this graph, world and schedule.

    Rules: replicas and ranks within the world; every stage holds a node, every node in a stage, no edge going back to an
    earlier stage, no uncrossable value sent across a boundary (codegen.boundary), no module with
    parameters called from two stages (codegen.build.check_shared_modules); under a schedule
    without a flush (pipedream) no replicated stage and no tie split across stages (runtime.build.tied); under
    interleaved, loop placement on p >= 2 ranks (`check_placement`).
    `schedule` None (a coordinator that does not know the workers' schedule) leaves the schedule's
    rules to the workers; `modules` None (the coordinator holds no layers) leaves to them whether a
    split tie is a buffer. Neither can pass there what fails here: the workers run this same check.
    """
    if plan.num_ranks > world_size:  # before with_default_ranks allocates a rank per replica
        per_stage = ", ".join(str(s.num_replicas) for s in plan.stages[:8]) + (", ..." if plan.num_stages > 8 else "")
        raise PlanError(f"plan v{plan.version} places {plan.num_ranks} replica(s) (per stage: {per_stage}) but the world "
                        f"has {world_size} rank(s); replicas are bounded by the world size")
    plan = plan.with_default_ranks()
    check_plan_fits(plan, world_size)
    empty = [s.stage_id for s in plan.stages if not s.node_ids]
    if empty:  # its module would take no input and hand nothing on: the run failed at its first forward
        raise PlanError(f"plan v{plan.version}: stage(s) {empty} hold no nodes; every stage needs at least one layer: "
                        "give each at least one node of a neighbouring stage, or use a plan with fewer stages")
    if schedule is not None:
        check_placement(plan, schedule)
        check_schedule(graph, plan, schedule)
        if schedule not in FLUSH_SCHEDULES and any(s.num_replicas > 1 for s in plan.stages):
            raise PlanError(f"the {schedule} schedule does not support replicated stages (each microbatch is an update, "
                            "which would need an all-reduce per microbatch); use 1f1b or gpipe, or a straight plan")
    ties = plan_ties(graph, plan)
    if modules is not None:
        check_trainable(ties, modules)
    # A module with parameters called from two stages: the worker's build_stage refuses it, after the move.
    check_shared_modules(graph, plan.stage_of)
    boundaries = stage_boundaries(graph, plan.stage_of)
    return CheckedPlan(plan, boundaries, ties)


def check_placement(plan: Plan, schedule: str) -> None:
    """Several stages per rank only under the interleaved schedules, and they only with them: stage k on rank
    k % p (replica i on rank k % p + i*p), p >= 2 (two consecutive stages
    never share a rank, so every edge is a message); or, under zbv, two stages per rank in a V (rank r: r and
    2p-1-r; p-1 hands to p on its rank, no message)."""
    shared = any(len(plan.stages_of_rank(r)) > 1 for s in plan.stages for r in s.ranks)
    if schedule not in MULTI_STAGE_SCHEDULES:
        if shared:
            raise PlanError(f"plan v{plan.version} places several stages on one rank (loop placement); only the "
                            f"interleaved schedules run that: use --schedule (TrainConfig.schedule) interleaved or zbinterleaved, or one "
                            f"stage per rank")
        return
    if schedule in V_SCHEDULES:
        if not plan.is_v_placement:
            held = [s.ranks for s in plan.stages[:12]]
            raise PlanError(f"the {schedule} schedule needs 2p stages on p >= 2 ranks in a V: stage k on rank k for "
                            f"k < p, 2p-1-k after (replica i on that rank + i*p); plan v{plan.version} has "
                            f"{plan.num_stages} stage(s) on ranks {held}{' ...' if plan.num_stages > 12 else ''}")
        return
    if plan.loop_width < 2:
        ranks = [list(s.ranks) for s in plan.stages[:12]]
        raise PlanError(f"the interleaved schedule needs loop placement over p >= 2 ranks: stage k on rank k % p with "
                        f"p*v stages, v >= 2 (replica i of every stage on rank k % p + i*p); plan v{plan.version} has "
                        f"{plan.num_stages} stage(s) on ranks {ranks}{' ...' if plan.num_stages > 12 else ''} (use 1f1b "
                        "for one stage per rank)")


def check_switchable(schedule: Optional[str]) -> None:
    """Refuse a live plan switch the engine cannot make: none today. Every schedule drains its step, so nothing is
    in flight at a step boundary (zero bubble: every W too); layers move by owner rank (wire/migration.py), so
    the loop schedules switch from a loop plan to a loop plan and zbv from a V to a V (`check_placement` refuses
    any other new plan). The workers and the coordinator call it before `check_plan`: the place for a schedule
    that cannot switch."""
    del schedule
