"""The one contiguous partitioner: p stages over one topological order, stage k on worker k (or, for
interleaved 1F1B, p*v stages with stage k on worker k % p: `loop_plan`; for ZBV, 2p stages in a V: `v_plan`).

The straight solver (`straight.py`, through `partition`'s one-level fast path) with the given worker
speeds, or unit speeds for an "even" split. Nodes are priced by their profiled time (`compute_ms`)
and nothing else. A graph without any timings (traced, not profiled) is priced by what each stage must
hold: its parameter bytes (gradients and optimizer state are the same multiple of them for every stage),
so a Llama's embedding and LM head, one node each, weigh what they hold; node counts never decide.
Only a graph with neither timings nor parameters counts every node alike.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import LOOP_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.loop import loop_rank_plan, v_rank_plan
from model_parallel.optimizer.memory import (OFFLOAD_CHUNK_BYTES, OPTIMIZER_STATE, Footprint, MemoryLimit, loop_rank_parts,
                                             offload_bytes, plan_footprint)
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.states import preprocess, prefix_states
from model_parallel.optimizer.straight import smallest_memory


# Parameter-free nodes of an untimed graph weigh this share of the mean parameter node: enough to split
# a parameter-free stretch evenly among ties, too little to move a cut off the parameter balance.
TIE_SHARE = 1e-3
# Bounds tried between a memory cap and a lower bound (loop and V plans: 1/v of it; a straight split: the least any
# split holds).
LOOP_SHARES = 8
BISECT = 0.01  # a refusal names the least memory per worker that fits to this share


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
        footprint = footprint or Footprint()
        options = replace(options, use_memory_constraint=True, memory_model="footprint", footprint=footprint)
        least = _least_held(priced, len(ranks), footprint)
        plan = _fitting_split(priced, hierarchy, options, float(memory_per_worker), least)
        if plan is None:
            raise InfeasibleError(_no_fit(priced, hierarchy, options, footprint, float(memory_per_worker), least))
    else:
        plan = partition(priced, hierarchy, options)
    stages = tuple(replace(s, ranks=(int(ranks[i]),)) for i, s in enumerate(plan.stages))
    return replace(plan, stages=stages)


def _least_held(priced: Graph, num_stages: int, footprint: Footprint) -> float:
    """The least predicted peak per worker any split reaches by the search's sums (the values a stage sends and
    receives come on top), an offloaded optimizer state's chunk included; inf when no split exists."""
    states = prefix_states(preprocess(priced, "footprint", footprint.schedule in ZERO_BUBBLE_SCHEDULES))
    return smallest_memory(states, num_stages, footprint) + offload_bytes(footprint)


def _fitting_split(priced: Graph, hierarchy: Hierarchy, options: PartitionOptions, cap: float,
                   least: float) -> Optional[Plan]:
    """The most even split whose every stage's predicted peak fits `cap`, or None. The search bounds what a stage
    holds; the values it sends and receives come on top, and `partition` refuses a split they tip over. A tighter
    bound makes the search pick another split, which may fit: the bound is stepped down from the cap to the least
    any split holds (without this a cap was refused while a smaller one fitted: 0.27 GB planned, 0.28 refused)."""
    constant = offload_bytes(options.memory)  # an offloaded state's chunk: a constant per stage on top of the sums
    if not cap >= least:  # (inf, nan: no split at all)
        return None
    for i in range(LOOP_SHARES + 1):
        bound = cap - i * (cap - least * (1 + 1e-9)) / LOOP_SHARES
        try:
            return partition(priced, replace(hierarchy, memory_bytes=bound - constant), replace(options, memory_cap=cap))
        except InfeasibleError:
            continue
    return None


def _least_cap(fits: Callable[[float], bool], low: float, high: float) -> float:
    """The least cap in (low, high] that `fits`, to `BISECT` (`high` fits, `low` does not)."""
    while high > low * (1 + BISECT):
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def _no_fit(priced: Graph, hierarchy: Hierarchy, options: PartitionOptions, footprint: Footprint, limit: float,
            least: float) -> str:
    """Why no split fits `limit`, with the smallest memory per worker that does: the least any split holds when a
    split fits there, else bisected (to `BISECT`) up to a cap `_fitting_split` plans under, so the figure works."""
    num_stages = len(options.worker_speeds or ())
    settings = f"{footprint.optimizer}, {footprint.schedule}, {footprint.microbatches or num_stages} microbatches"
    if not math.isfinite(least):
        return f"cannot split the graph into {num_stages} stages at all"

    def fits(cap: float) -> bool:
        return _fitting_split(priced, hierarchy, options, cap, least) is not None

    def plans_offloaded(offloaded: Footprint) -> bool:
        return _fitting_split(priced, hierarchy, replace(options, footprint=offloaded), limit,
                              _least_held(priced, num_stages, offloaded)) is not None

    need = least
    if not fits(least * (1 + 1e-9)):  # the values sent and received tip the least-holding split over: search up
        low = max(limit, least)
        high = low * 1.25
        while not fits(high):  # ends: at a cap above the balanced split's peak the search's first split fits
            if not math.isfinite(high):
                return f"no split of the model into {num_stages} stages fits any memory per worker ({settings})"
            low, high = high, high * 1.25
        need = math.ceil(_least_cap(fits, low, high))
    why = ("once the values each stage sends and receives are counted" if least <= limit else
           "(predicted peak: parameters, gradients, optimizer state and saved activations)")
    return (f"no split of the model into {num_stages} stages fits {limit / 1e9:.3g} GB per worker {why} ({settings}); "
            f"the smallest that fits is {need / 1e9:.3g} GB ({need:.0f} bytes): raise memory_per_worker to at least "
            f"that, or use more workers{_offload_advice(footprint, limit, plans_offloaded)}")


def _offload_advice(footprint: Footprint, limit: float, plans_with: Callable[[Footprint], bool]) -> str:
    """The third way out, where it works: with the optimizer state on disk (a chunk of it in memory) a plan fits
    `limit` (`plans_with(footprint)`: the same search under that footprint). Said only when it plans, so the advice
    is never one more refusal."""
    if OPTIMIZER_STATE[footprint.optimizer] == 0 or footprint.offload_chunk is not None:
        return ""
    if not plans_with(replace(footprint, offload_chunk=OFFLOAD_CHUNK_BYTES)):
        return ""
    return (f", or keep the optimizer state on local disk, where a plan fits {limit / 1e9:.3g} GB: "
            f"RunOptions(offload_optimizer=DIR) (the worker's --offload_optimizer DIR; {OFFLOAD_CHUNK_BYTES / 1e6:g} MB "
            f"of state in memory at once)")


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
              memory_per_worker: Optional[float] = None, footprint: Optional[Footprint] = None,
              schedule: str = "interleaved") -> Plan:
    """A loop schedule's plan (interleaved or zbinterleaved): `num_ranks * stages_per_rank` contiguous stages
    balanced by profiled cost (each rank's summed stages over its speed: `loop.loop_rank_plan`), stage k on rank
    k % p (loop placement). With `memory_per_worker`, a rank's stages must fit together by `schedule`'s footprint
    (`_rank_sum_split`): zbinterleaved keeps each microbatch until its W, so it needs more than interleaved."""
    if schedule not in LOOP_SCHEDULES:
        raise PlanError(f"a loop plan is for {' or '.join(LOOP_SCHEDULES)}, got schedule {schedule!r}")
    if num_ranks < 2 or stages_per_rank < 2:
        raise PlanError(f"interleaved 1F1B needs p >= 2 ranks with v >= 2 stages each, got p={num_ranks}, "
                        f"v={stages_per_rank}; use one stage per rank (1f1b) otherwise")
    ranks = [k % num_ranks for k in range(num_ranks * stages_per_rank)]
    return _rank_sum_split(graph, ranks, loop_rank_plan, schedule, speeds, memory_per_worker, footprint,
                           {"stages_per_rank": stages_per_rank})


def v_plan(graph: Graph, num_ranks: int, speeds: Optional[Sequence[float]] = None,
           memory_per_worker: Optional[float] = None, footprint: Optional[Footprint] = None) -> Plan:
    """ZBV's plan: 2p contiguous stages in a V (rank r holds stages r and 2p-1-r) balanced by profiled cost, each
    rank's two stages summed over its speed (`loop.v_rank_plan`; stages p-1 and p share a rank, so the even
    per-stage split does not minimise the slowest rank once layers differ in cost). With `memory_per_worker`, a
    rank's two stages must fit together by the zbv footprint (`_rank_sum_split`, as `loop_plan`)."""
    if num_ranks < 2:
        raise PlanError(f"zbv places 2 stages per rank in a V over p >= 2 ranks, got p={num_ranks}; use one stage "
                        "per rank (1f1b, zbh1) otherwise")
    ranks = [min(k, 2 * num_ranks - 1 - k) for k in range(2 * num_ranks)]
    return _rank_sum_split(graph, ranks, v_rank_plan, "zbv", speeds, memory_per_worker, footprint, {})


def _rank_sum_split(graph: Graph, ranks: Sequence[int], planner: Callable[[Graph, Sequence[int], Sequence[float]], Plan],
                    schedule: str, speeds: Optional[Sequence[float]], memory_per_worker: Optional[float],
                    footprint: Optional[Footprint], extra: Mapping[str, Any], explain: bool = True) -> Plan:
    """Stage k on `ranks[k]`, balanced by each rank's summed stages over its speed (`planner`: the loop's or the V's
    rank-sum plan), each stage's memory by `schedule`'s footprint. Under `memory_per_worker`, the first split whose
    ranks' summed footprints fit (`fitting`), else an `InfeasibleError` naming the rank over and the least memory per
    worker that fits (bisected to 1 %; without `explain` a bare one, for a caller that only asks whether it fits)."""
    p = len(set(ranks))
    v = len(ranks) // p
    if speeds is not None and len(speeds) != p:
        raise PlanError(f"got {len(speeds)} speed(s) for {p} worker(s); give one speed per worker")
    per_stage = [float(speeds[r]) for r in ranks] if speeds is not None else [1.0] * len(ranks)
    model = replace(footprint or Footprint(), schedule=schedule)

    def placed(plan: Plan) -> Plan:  # the placement, each stage's memory by the footprint, the time by rank sums
        plan = replace(plan, stages=tuple(replace(s, ranks=(int(ranks[s.stage_id]),)) for s in plan.stages))
        parts = plan_footprint(graph, plan, model)
        sums: dict[int, float] = {}
        for stage in plan.stages:  # a rank runs its stages in turn (a per-stage fallback is priced as it runs)
            sums[stage.ranks[0]] = sums.get(stage.ranks[0], 0.0) + stage.compute_s / per_stage[stage.stage_id]
        return replace(plan, stages=tuple(replace(s, memory_bytes=part["total"]) for s, part in zip(plan.stages, parts)),
                       time_per_minibatch_s=max(sums.values()),
                       extra={**plan.extra, "schedule": schedule, **extra, "memory_model": "footprint",
                              "footprint": model.to_dict(), "memory": parts,
                              "time_per_minibatch_of": "slowest rank, its stages summed"})

    plan = placed(planner(priced_graph(graph), ranks, per_stage))
    if memory_per_worker is None:
        return plan
    smallest: list[Optional[tuple[float, Plan]]] = []  # computed once, when a cap is missed

    def least() -> Optional[Plan]:
        """The split whose largest stage is smallest, placed (None without one)."""
        if not smallest:
            found = _smallest_stages(graph, len(ranks), per_stage, model)
            smallest.append(None if found is None else (found[0], placed(found[1])))
        return None if smallest[0] is None else smallest[0][1]

    def fitting(cap: float) -> Optional[Plan]:
        """The balanced split when its ranks fit `cap`; else the most even split whose every stage fits a share of the
        cap, from the whole cap down to 1/v of it (the solver bounds each stage, a rank holds v; at 1/v any split that
        passes fits); else the split whose largest stage is smallest; None when none of them fits."""
        def candidates() -> Iterator[Optional[Plan]]:
            yield plan
            for i in range(LOOP_SHARES + 1):
                try:
                    yield placed(straight_plan(graph, range(len(ranks)), per_stage, cap * (1 - i * (1 - 1 / v) / LOOP_SHARES),
                                               model))
                except InfeasibleError:
                    continue
            yield least()

        return next((c for c in candidates() if c is not None and max(_rank_bytes(graph, c, model)) <= cap), None)

    def plans_offloaded(offloaded: Footprint) -> bool:
        return _plans(lambda: _rank_sum_split(graph, ranks, planner, schedule, speeds, cap, offloaded, extra, False))

    cap = float(memory_per_worker)
    found = fitting(cap)
    if found is not None:
        return found
    if not explain:  # the refusal's bisection below solves dozens of times: not for a yes-or-no question
        raise InfeasibleError(f"no {schedule} split fits {cap:.0f} bytes per worker")
    try:
        MemoryLimit(cap, model).check(graph, plan, f"the balanced {schedule} split")
        over = f"the balanced {schedule} split does not fit"  # (unreached: `fitting` returns it when it fits)
    except InfeasibleError as error:
        over = str(error)
    # Both the balanced split and the least one fit their fullest rank's bytes; the least cap `fitting` accepts lies
    # between that and the smallest largest stage (a rank holds it, and more).
    high = min(max(_rank_bytes(graph, split, model)) for split in (plan, least()) if split is not None)
    low = max(cap, smallest[0][0] if smallest[0] is not None else 0.0, 1.0)
    high = _least_cap(lambda middle: fitting(middle) is not None, low, high)
    raise InfeasibleError(f"{over}. No split whose every stage fits 1/{v} of it ({cap / v / 1e9:.3g} GB) or a larger "
                          f"share with its ranks' sums fitting exists either; the least memory per worker that fits is "
                          f"{high / 1e9:.3g} GB ({math.ceil(high)} bytes, found to {BISECT:.0%}): raise memory_per_worker to at "
                          f"least that, or use more ranks{_offload_advice(model, cap, plans_offloaded)}")


def _plans(make: Callable[[], Plan]) -> bool:
    """Whether `make` plans (False where it refuses for memory)."""
    try:
        make()
    except InfeasibleError:
        return False
    return True


def _smallest_stages(graph: Graph, count: int, speeds: Sequence[float], model: Footprint) -> Optional[tuple[float, Plan]]:
    """The least largest stage's footprint any `count`-stage split reaches (the search's sums), and the most even
    split there (None when there is none, or when the values its stages send and receive tip it over)."""
    priced = priced_graph(graph)
    states = prefix_states(preprocess(priced, "footprint", model.schedule in ZERO_BUBBLE_SCHEDULES))
    need = smallest_memory(states, count, model)
    if not math.isfinite(need):
        return None
    try:
        return need, straight_plan(graph, range(count), speeds, need * (1 + 1e-9), model)
    except InfeasibleError:
        return None


def _rank_bytes(graph: Graph, plan: Plan, model: Footprint) -> list[float]:
    """Each rank's predicted bytes, its stages together (`memory.loop_rank_parts`)."""
    merged = loop_rank_parts(plan_footprint(graph, plan, model), plan, model.microbatches, model.schedule)
    return [summed["total"] for _, (_, summed) in sorted(merged.items())]
