"""Per-stage costs of a given assignment of nodes to stages, under PipeDream's cost model.

Used to fill a `Plan`'s per-stage numbers and by the live rebalancer (`predict_stage_times`) to
score an existing plan under measured worker speeds. `Input*` sources cost nothing (data loading).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Level, Plan


@dataclass(frozen=True)
class StageCost:
    """Sums over one stage's nodes: compute seconds, parameter and activation bytes, bytes in and out."""

    compute_s: float
    parameter_bytes: float
    activation_bytes: float
    input_bytes: float
    output_bytes: float


def data_parallel_seconds(compute: Any, parameters: Any, levels: Sequence[Level]) -> Any:
    """PipeDream's time of one stage replicated on every machine of `levels` (innermost first): at each
    level `(t + 4 (M - 1) P / (B M) / M_inside) / M`. Works elementwise on numpy arrays."""
    time, within = compute, 1
    for level in levels:
        n = level.num_machines
        time = (time + 4 * (n - 1) * parameters / (level.bandwidth * n) / within) / n
        within = n
    return time


def stage_costs(graph: Graph, stage_of: dict[str, int], num_stages: int) -> list[StageCost]:
    """Costs of every stage; a value crossing several boundaries counts at each (it is passed through)."""
    compute = [0.0] * num_stages
    params = [0.0] * num_stages
    acts = [0.0] * num_stages
    inputs = [0.0] * num_stages
    outputs = [0.0] * num_stages
    for node in graph.nodes:
        if node.node_id not in stage_of:
            raise PlanError(f"node {node.node_id!r} is in no stage of the plan; a plan must cover every node")
        if node.is_input and not graph.predecessors[node.node_id]:
            continue  # PipeDream zeroes model inputs: data loading is not stage work
        stage = stage_of[node.node_id]
        compute[stage] += node.compute_ms / 1000.0
        params[stage] += node.parameter_size
        acts[stage] += node.activation_bytes
        last = max((stage_of[s] for s in graph.successors[node.node_id]), default=stage)
        for boundary in range(stage, last):  # live across the cut after `boundary`
            outputs[boundary] += node.activation_bytes
            inputs[boundary + 1] += node.activation_bytes
    return [StageCost(*values) for values in zip(compute, params, acts, inputs, outputs)]


def stash_factor(memory_model: str, num_ranks: int, ranks_before: int, replicas: int) -> int:
    """How many (activations + weights) copies one replica holds (see `dp.py` for the two models)."""
    if memory_model == "1f1b":
        return math.ceil((num_ranks - ranks_before) / replicas)
    return math.ceil((num_ranks - ranks_before - replicas) / replicas)


def predict_stage_times(
    graph: Graph,
    plan: Plan,
    worker_speeds: Optional[Sequence[float]] = None,
    bandwidth: float = 1e9,
    activation_compression_ratio: Optional[float] = None,
) -> tuple[float, ...]:
    """Predicted seconds per minibatch of each stage of `plan` on workers of the given speeds.

    Stage time = max((T + 4 (r-1) W / (B r)) / (r * slowest speed of its ranks), transfers), where the input
    and output transfers `2 bytes / (B r R)` count only with a compression ratio R (as PipeDream).
    With speeds all 1.0 this is the optimizer's own model, so `max(...)` equals
    `plan.time_per_minibatch_s` for a one-level straight plan. Speeds are indexed by rank. (PipeDream's
    DP never charges the first stage for its output; here it is charged, at the first stage's replicas,
    so a replicated first stage can predict more than the plan says.)
    """
    plan = plan.with_default_ranks()
    costs = stage_costs(graph, plan.stage_of, plan.num_stages)
    speeds = list(worker_speeds) if worker_speeds is not None else None
    if speeds is not None:
        needed = max(r for s in plan.stages for r in s.ranks) + 1
        if len(speeds) < needed:
            raise PlanError(f"worker_speeds has {len(speeds)} value(s) but the plan uses ranks up to {needed - 1}; give one speed per rank")
        if any(not (math.isfinite(s) and s > 0) for s in speeds):
            raise PlanError(f"worker_speeds must be positive numbers (1.0 = as profiled), got {speeds}")
    times = []
    for stage, cost in zip(plan.stages, costs):
        r = stage.num_replicas
        # r replicas share the microbatches round-robin (the runtime's rule): the slowest sets the pace.
        speed = r * min(speeds[rank] for rank in stage.ranks) if speeds is not None else r
        time = (cost.compute_s + (4 * (r - 1) * cost.parameter_bytes) / (bandwidth * r)) / speed
        if activation_compression_ratio is not None:
            time = max(time, (2.0 * cost.input_bytes) / (bandwidth * r) / activation_compression_ratio)
            if stage.stage_id < plan.num_stages - 1:
                time = max(time, (2.0 * cost.output_bytes) / (bandwidth * r) / activation_compression_ratio)
        times.append(time)
    return tuple(times)
