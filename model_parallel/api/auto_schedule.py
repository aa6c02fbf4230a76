"""`schedule="auto"` for a job: each flush schedule's candidate plan, priced from the profile, simulated; the fastest that fits.

Each schedule's plan comes from the job builder (api/job.py `_schedule_plan`): 1f1b and gpipe run the
job's own plan (the one given, the package's, or the even split, under `memory_per_worker` the most even
that fits that schedule's footprint); interleaved and zbinterleaved run the loop plan (2 stages per rank),
zbv the V balanced by rank sums (`optimizer.contiguous.v_plan`). A candidate that cannot run (no split fits the memory,
the plan's rules, the config: `JobSpec.schedule_refusals`) is refused with its reason. Stage times are
the profile's forward and backward ms of each stage's nodes for one microbatch; a stage edge costs its
crossing bytes over the optimizer's default 1 GB/s link. A graph without timings (traced, not profiled)
is priced by parameter bytes, as the even split is (`optimizer.contiguous.priced_graph`): the line then
says "units", not ms, and the transfers are left out. The choice rides on the plan (`plan.extra["schedule"]`),
so every rank, the plan table and a broadcast plan agree on it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from model_parallel.errors import ModelParallelError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import FLUSH_SCHEDULES, MULTI_STAGE_SCHEDULES
from model_parallel.graph.hierarchy import Level
from model_parallel.graph.plan import Plan
from model_parallel.runtime.step.auto import EXTRA_KEY, Candidate, Choice, choose_schedule, proxy_times, stage_times
from model_parallel.runtime.step.interleaved import world_refusal

logger = logging.getLogger(__name__)

LINK_BYTES_PER_S = Level(num_machines=1).bandwidth  # the optimizer's default link: what a plan is priced with


def edge_transfers(graph: Graph, plan: Plan, scale: float) -> tuple[float, ...]:
    """Per edge k -> k+1 of `plan`: ms to send the values crossing it (produced before, consumed after; one
    microbatch's), over `LINK_BYTES_PER_S`."""
    stage_of, successors = plan.stage_of, graph.successors
    crossing = [0.0] * max(plan.num_stages - 1, 0)
    for node in graph.nodes:
        consumers = [stage_of[c] for c in successors[node.node_id]]
        last, first = max(consumers, default=-1), stage_of[node.node_id]
        for edge in range(first, last):  # passed through every stage in between
            crossing[edge] += node.activation_bytes * scale
    return tuple(1e3 * b / LINK_BYTES_PER_S for b in crossing)


def schedule_refusals(config: Any, measure_memory: bool, backend: str) -> dict[str, str]:
    """Schedules `auto` may not pick for a run of this `TrainConfig`, and why: the config's own rules and what several
    stages per rank cannot honour yet (NCCL: `runtime.step.multi_stage.check_supported`). `measure_memory` rules
    none out (every schedule measures a rank's stages in one meter); it stays for the callers that pass it."""
    from model_parallel.runtime.step.multi_stage import check_supported

    refusals: dict[str, str] = config.schedule_refusals()
    try:
        check_supported(backend)
    except ModelParallelError as error:
        for name in MULTI_STAGE_SCHEDULES:
            refusals.setdefault(name, str(error))
    return refusals


def _candidate_plan(graph: Graph, name: str, world_size: int, num_microbatches: int, refusals: Mapping[str, str],
                    plan_for: Callable[[str], Plan]) -> Plan:
    """The plan `name` would run for this job (raises a ModelParallelError saying why it cannot)."""
    from model_parallel.runtime.plancheck import check_plan

    if refusals.get(name):
        raise PlanError(refusals[name])
    refusal = world_refusal(name, world_size, num_microbatches)
    if refusal is not None:
        raise PlanError(refusal)
    plan = plan_for(name)
    # The schedule's rules (placement, ties); whether the plan fits the world is the engine's check (a single
    # process runs every stage of a plan for more ranks than it has).
    return check_plan(graph, plan, max(world_size, plan.num_ranks), name).plan


def resolve_auto(graph: Graph, world_size: int, num_microbatches: int, micro_batch: int, refusals: Mapping[str, str],
                 plan_for: Callable[[str], Plan], list_order: bool = True) -> Plan:
    """The plan of the schedule auto chooses (see the module docstring), the choice in its extra; logs the
    choice's line. `plan_for(name)`: the plan schedule `name` runs for this job (api.job), or a
    ModelParallelError saying why it cannot; `refusals`: schedules ruled out before that, with why.
    `list_order`: the zero-bubble candidates are priced in the order the run list-builds from the profile's times
    (runtime/step/list_order.py; a graph without timings runs, and is priced in, the fixed order).
    Raises ScheduleError when no flush schedule can run the job."""
    from model_parallel.optimizer.contiguous import priced_graph
    from model_parallel.optimizer.memory import activation_scale

    timed = any(node.compute_ms > 0 for node in graph.nodes)
    priced = graph if timed else priced_graph(graph)
    scale = activation_scale(graph, micro_batch) if timed else 1.0
    plans: dict[str, Plan] = {}
    candidates = []
    for name in FLUSH_SCHEDULES:
        try:
            plan = _candidate_plan(graph, name, world_size, num_microbatches, refusals, plan_for)
        except ModelParallelError as error:
            candidates.append(Candidate(name, refused=str(error).splitlines()[0]))
            continue
        plans[name] = plan
        transfers = edge_transfers(graph, plan, scale) if timed else 0.0
        times = stage_times(priced, plan, scale)
        if not timed:
            times = proxy_times(times)
        candidates.append(Candidate(name, times, transfers, list_order=list_order and timed))
    choice: Choice = choose_schedule(candidates, num_microbatches, world_size, "ms" if timed else "units")
    logger.info("%s", choice.line())
    plan = plans[choice.name]
    return replace(plan, extra={**dict(plan.extra), EXTRA_KEY: choice.to_extra()})
