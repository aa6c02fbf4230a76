"""The one contiguous partitioner: p stages over one topological order, stage k on worker k (or, for
interleaved 1F1B, p*v stages with stage k on worker k % p: `loop_plan`).

The straight solver (`straight.py`, through `partition`'s one-level fast path) with the given worker
speeds, or unit speeds for an "even" split. Nodes are priced by their profiled time (`compute_ms`)
and nothing else. A graph without any timings (traced, not profiled) is priced by what each stage must
hold: its parameter bytes (gradients and optimizer state are the same multiple of them for every stage),
so a Llama's embedding and LM head, one node each, weigh what they hold; node counts never decide.
Only a graph with neither timings nor parameters counts every node alike.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Optional

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import ZERO_BUBBLE_SCHEDULES
from model_parallel.graph.plan import Hierarchy, Plan
from model_parallel.optimizer.loop import loop_rank_plan
from model_parallel.optimizer.memory import Footprint, MemoryLimit, offload_bytes, plan_footprint
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.states import preprocess, prefix_states
from model_parallel.optimizer.straight import smallest_memory


# Parameter-free nodes of an untimed graph weigh this share of the mean parameter node: enough to split
# a parameter-free stretch evenly among ties, too little to move a cut off the parameter balance.
TIE_SHARE = 1e-3
LOOP_SHARES = 8  # `loop_plan` under a memory cap: per-stage bounds tried between the cap and 1/v of it


def priced_graph(graph: Graph) -> Graph:
    """`graph` as the split sees it: with no node timed, each node priced by its parameter bytes in
    `forward_ms` (1 ms a node when no node holds parameters either). (A weight read as a bare tensor stays
    with its readers anyway: `Node.crossable`.)"""
    if any(node.compute_ms > 0 for node in graph.nodes):
        return graph
    holding = [node.parameter_size for node in graph.nodes if node.parameter_size > 0]
    tie = TIE_SHARE * sum(holding) / len(holding) if holding else 0.0
    # (The metadata stays: its model outputs tell side effects apart, see optimizer/workload.py.)
    return graph.replace_nodes(replace(node, forward_ms=(node.parameter_size + tie) / 1e6 if holding else 1.0)
                               for node in graph.nodes)


def straight_plan(graph: Graph, ranks: Sequence[int], speeds: Optional[Sequence[float]] = None,
                  memory_per_worker: Optional[float] = None, footprint: Optional[Footprint] = None) -> Plan:
    """`len(ranks)` contiguous stages, stage k on `ranks[k]`, minimising the slowest `compute / speed_k`
    (exact over one topological order; of the cuts that reach it, the most even). Model inputs land in
    stage 0. With `memory_per_worker`, only splits whose every stage's predicted `footprint` fits it."""
    layers = sum(1 for node in graph.nodes if not (node.is_input and not graph.predecessors[node.node_id]))
    if not 1 <= len(ranks) <= layers:
        raise PlanError(
            f"cannot split {layers} layer node(s) into {len(ranks)} stage(s); choose 1..{layers} stages (workers)"
        )
    speeds = tuple(float(s) for s in speeds) if speeds is not None else (1.0,) * len(ranks)
    if len(speeds) != len(ranks):
        raise PlanError(f"got {len(speeds)} speed(s) for {len(ranks)} worker(s); give one speed per worker")
    options = PartitionOptions(straight_pipeline=True, cuts="topological", worker_speeds=speeds)
    hierarchy = Hierarchy.from_lists([len(ranks)])
    priced = priced_graph(graph)
    if memory_per_worker is not None:
        options = replace(options, use_memory_constraint=True, memory_model="footprint", footprint=footprint or Footprint())
        # An offloaded optimizer state's chunk is a constant per stage: the search bounds the rest (memory.offload_bytes).
        hierarchy = replace(hierarchy, memory_bytes=float(memory_per_worker) - offload_bytes(options.memory))
        try:
            plan = partition(priced, hierarchy, options)
        except InfeasibleError:
            raise InfeasibleError(_no_fit(priced, len(ranks), float(memory_per_worker), options)) from None
    else:
        plan = partition(priced, hierarchy, options)
    stages = tuple(replace(s, ranks=(int(ranks[i]),)) for i, s in enumerate(plan.stages))
    return replace(plan, stages=stages)


def _no_fit(priced: Graph, num_stages: int, limit: float, options: PartitionOptions) -> str:
    """Why no split fits `limit`, with the smallest memory per worker that does (the predicted peak of the
    split that needs least, sent and received values included)."""
    footprint = options.memory
    states = prefix_states(preprocess(priced, "footprint", footprint.schedule in ZERO_BUBBLE_SCHEDULES))
    constant = offload_bytes(footprint)  # an offloaded optimizer state's chunk, on top of the search's sums
    need = smallest_memory(states, num_stages, footprint) + constant
    settings = f"{footprint.optimizer}, {footprint.schedule}, {footprint.microbatches or num_stages} microbatches"
    if not math.isfinite(need):
        return f"cannot split the graph into {num_stages} stages at all ({states.num_states} cut points)"
    try:  # the peak the plan reports adds boundary values to what the search checked
        fitting = partition(priced, Hierarchy.from_lists([num_stages], memory_bytes=(need - constant) * (1 + 1e-9)),
                            options)
        need = max(need, max(s.memory_bytes for s in fitting.stages))
    except InfeasibleError:
        pass
    if need <= limit:  # the search's sums fit; the values a stage sends and receives tip it over
        return (f"the most even split into {num_stages} stages that fits {limit / 1e9:.3g} GB per worker by its held "
                f"bytes needs more once the values each stage sends and receives are counted ({settings}); raise "
                f"memory_per_worker by a few percent, or use more workers")
    return (f"no split of the model into {num_stages} stages fits {limit / 1e9:.3g} GB per worker (predicted peak: "
            f"parameters, gradients, optimizer state and saved activations; {settings}); the smallest that fits is "
            f"{need / 1e9:.3g} GB ({need:.0f} bytes): raise memory_per_worker to at least that, or use more workers")


def even_stages(graph: Graph, num_stages: int, replicas: Optional[Mapping[int, int]] = None,
                memory_per_worker: Optional[float] = None, footprint: Optional[Footprint] = None) -> Plan:
    """`num_stages` contiguous stages of about equal time (the straight solver with unit speeds); ranks in
    stage order, `replicas[k]` of them for stage k (default 1). The default plan of the runtime. With
    `memory_per_worker` (bytes), the most even split whose predicted `footprint` fits on every stage, or
    an `InfeasibleError` naming the smallest memory per worker that would fit."""
    replicas = dict(replicas or {})
    if memory_per_worker is not None and any(int(r) > 1 for r in replicas.values()):
        raise PlanError("memory_per_worker plans one worker per stage; drop --stage_to_num_ranks (replicas) or give a plan")
    unknown = sorted(s for s in replicas if not 0 <= int(s) < num_stages)
    if unknown:
        raise PlanError(f"--stage_to_num_ranks names stage(s) {unknown} but the plan has stages 0..{num_stages - 1}; "
                        "name only existing stages (or raise --num_stages)")
    plan = straight_plan(graph, range(num_stages), memory_per_worker=memory_per_worker, footprint=footprint)
    stages = tuple(replace(s, num_replicas=int(replicas.get(s.stage_id, 1)), ranks=()) for s in plan.stages)
    return replace(plan, stages=stages).with_default_ranks()


def loop_plan(graph: Graph, num_ranks: int, stages_per_rank: int = 2, speeds: Optional[Sequence[float]] = None,
              memory_per_worker: Optional[float] = None, footprint: Optional[Footprint] = None) -> Plan:
    """Interleaved 1F1B's plan: `num_ranks * stages_per_rank` contiguous stages balanced by profiled cost (each
    rank's summed stages over its speed: `loop.loop_rank_plan`), stage k on rank k % p (loop placement). With
    `memory_per_worker`, a rank's stages must fit together: the balanced split when its ranks' summed footprints
    fit, else the most even split whose every stage fits 1/v of it; an `InfeasibleError` names the rank over."""
    if num_ranks < 2 or stages_per_rank < 2:
        raise PlanError(f"interleaved 1F1B needs p >= 2 ranks with v >= 2 stages each, got p={num_ranks}, "
                        f"v={stages_per_rank}; use one stage per rank (1f1b) otherwise")
    if speeds is not None and len(speeds) != num_ranks:
        raise PlanError(f"got {len(speeds)} speed(s) for {num_ranks} worker(s); give one speed per worker")
    count = num_ranks * stages_per_rank
    per_stage = [float(speeds[k % num_ranks]) for k in range(count)] if speeds is not None else None
    model = replace(footprint or Footprint(), schedule="interleaved")

    def placed(plan: Plan) -> Plan:  # loop placement, each stage's memory by the interleaved footprint
        plan = replace(plan, stages=tuple(replace(s, ranks=(s.stage_id % num_ranks,)) for s in plan.stages))
        parts = plan_footprint(graph, plan, model)
        return replace(plan, stages=tuple(replace(s, memory_bytes=p["total"]) for s, p in zip(plan.stages, parts)),
                       extra={**plan.extra, "schedule": "interleaved", "stages_per_rank": stages_per_rank,
                              "memory_model": "footprint", "footprint": model.to_dict(), "memory": parts})

    # Balanced by rank (each rank's v stages summed), not by stage; under a cap the per-stage bounds below.
    plan = placed(loop_rank_plan(priced_graph(graph), [k % num_ranks for k in range(count)], per_stage or [1.0] * count))
    if memory_per_worker is None:
        return plan
    limit = MemoryLimit(float(memory_per_worker), model)
    try:
        limit.check(graph, plan, "the balanced interleaved split")
        return plan
    except InfeasibleError as balanced:
        # The solver bounds each stage, a rank holds v of them: bound each stage by a share of the cap, from the
        # whole cap down to 1/v of it (where any split that passes fits), and keep the first split whose ranks fit.
        cap, v = float(memory_per_worker), stages_per_rank
        for share in [cap * (1 - i * (1 - 1 / v) / LOOP_SHARES) for i in range(LOOP_SHARES + 1)]:
            try:
                capped = placed(straight_plan(graph, range(count), per_stage, share, model))
                limit.check(graph, capped, "the interleaved split")
                return capped
            except InfeasibleError:
                continue
        raise InfeasibleError(f"{balanced}. No split whose every stage fits 1/{v} of it ({cap / v / 1e9:.3g} GB) or a "
                              "larger share with its ranks' sums fitting exists either") from None
