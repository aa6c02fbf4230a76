"""`--schedule auto` after a live switch: the coordinator chooses the new plan's schedule again from measured times.

The workers chose a schedule once, at the start, from the profile (api/auto_schedule.py). When the coordinator
issues plan v+1 to such a job (`Rebalancer.issue`), it simulates every flush schedule the new plan can run and
sends the fastest in the switch (`Command.schedule`); every rank builds the new stage under it. Pure and
deterministic (the same inputs, the same choice), like the start's chooser, whose simulator it reuses
(runtime/step/auto.py `choose_schedule`).

Times: the coordinator measures one number per rank, its compute ms per step (forward and backward together).
A stage's time on its new rank is its profiled ms x the calibration (measured / profiled on a nominal rank) /
that rank's speed / m microbatches; it is split into forward and backward by the profile's own ratio for the
stage's nodes, and the backward into input and weight gradients by the start's estimate (`stage_times`: half
of a node with parameters' backward is W). A graph without timings (the cost proxy) splits 1 : 2 (F : B), I = W.
Transfers are not priced (the coordinator does not know the microbatch's bytes on the wire).

Candidates: the flush schedules whose rules the new plan passes (`plancheck.check_plan`: one stage per rank
runs 1f1b, gpipe and zbh1; a loop plan interleaved and zbinterleaved; a V zbv) and, under
`--memory_per_worker`, whose footprint (the schedule's in-flight rule, optimizer/memory.py) fits every rank.
The placement is the policy's (the re-choice never changes it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Optional

from model_parallel.errors import InfeasibleError, ModelParallelError, PlanError, ScheduleError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import FLUSH_SCHEDULES, MULTI_STAGE_SCHEDULES, V_SCHEDULES
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.simulate import StageTimes
from model_parallel.runtime.step.auto import Candidate, Choice, choose_schedule, proxy_times, stage_times

TIMES_NOTE = "times: each rank's measured ms per step, split F/B by the profile's ratio, I/W estimated"


def measured_times(graph: Graph, plan: Plan, speeds: Mapping[int, float], calibration: float,
                   num_microbatches: int) -> tuple[StageTimes, ...]:
    """Per stage of `plan`: forward, backward, input- and weight-gradient ms of one microbatch on the rank(s) that
    will run it (see the module docstring); a rank never measured counts as nominal (speed 1)."""
    timed = any(node.backward_ms > 0 for node in graph.nodes)
    times = stage_times(graph, plan, calibration / num_microbatches)
    if not timed:
        times = proxy_times([StageTimes(t.forward_ms / 3, 0.0) for t in times])  # the proxy's total: 1/3 forward
    out = []
    for stage, t in zip(plan.with_default_ranks().stages, times):
        speed = min(max(speeds.get(rank, 1.0), 1e-9) for rank in stage.ranks)  # a replicated stage: its slowest
        out.append(StageTimes(t.forward_ms / speed, t.backward_ms / speed,
                              None if t.input_ms is None else t.input_ms / speed,
                              None if t.weight_ms is None else t.weight_ms / speed))
    return tuple(out)


def placement_refusal(plan: Plan, name: str) -> Optional[str]:
    """Why schedule `name` cannot run `plan`'s placement, in a few words (plancheck.check_placement says it at length)."""
    if name in V_SCHEDULES:
        return None if plan.is_v_placement else "placement: not a V"
    if name in MULTI_STAGE_SCHEDULES:
        return None if plan.loop_width >= 2 else "placement: not a loop"
    return "placement: several stages per rank" if plan.several_stages_per_rank else None


def rechoose(graph: Graph, plan: Plan, world_size: int, speeds: Mapping[int, float], calibration: float,
             num_microbatches: int, memory: Any = None, list_order: bool = True) -> Choice:
    """The schedule `plan` (ranks assigned) should run, from the measured `speeds` (see the module docstring);
    `memory`: an optimizer.memory.MemoryLimit (its footprint's schedule is replaced by each candidate's); `list_order`:
    the zero-bubble candidates are priced in the order the workers list-build from these times (else the fixed one).
    Raises InfeasibleError (one was over the memory limit) or PlanError naming every candidate's reason when none
    can run."""
    from model_parallel.runtime.plancheck import check_plan

    plan = plan.with_default_ranks()
    times = measured_times(graph, plan, speeds, calibration, num_microbatches)
    candidates = []
    for name in FLUSH_SCHEDULES:
        why: Optional[str] = placement_refusal(plan, name)
        try:
            if why is None:
                check_plan(graph, plan, world_size, name)
            if why is None and memory is not None:
                replace(memory, footprint=replace(memory.footprint, schedule=name)).check(graph, plan, f"plan v{plan.version}")
        except InfeasibleError as error:
            why = f"memory: {str(error).splitlines()[0]}"
        except ModelParallelError as error:
            why = str(error).splitlines()[0]
        # Priced in the order the workers list-build from these times (the plan carries them: Rebalancer.issue)
        candidates.append(Candidate(name, refused=why) if why else Candidate(name, times, list_order=list_order))
    try:
        return choose_schedule(candidates, num_microbatches, plan.loop_width or plan.v_width or plan.num_ranks)
    except ScheduleError as error:  # over the memory limit is the plan's fault; anything else the workers would refuse
        over = any(c.refused is not None and c.refused.startswith("memory: ") for c in candidates)
        raise (InfeasibleError if over else PlanError)(f"plan v{plan.version}: {error}") from None
