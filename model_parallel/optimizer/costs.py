"""PipeDream's cost model, written once: what a stage costs, and the costs of a given plan.

The terms (FORMATS.md), for a stage of compute T and weights W replicated r times over links of B
bytes/s, each replica holding g machines of the level inside (g = 1 on the innermost level):

    all-reduce      4 (r - 1) W / (B r g)                 `allreduce_seconds`
    stage time      (T + all-reduce) / r                  `stage_seconds` (r times the slowest speed with speeds)
    transfer        2 O / (B r R)                         `transfer_seconds` (O bytes cross, compression R)

Every solver (dp.py, straight.py, brute_force.py, the plan's own numbers and the rebalancer's
`predict_stage_times`) calls these, elementwise on numpy arrays or on floats, so their results agree
to the bit. (The search's compiled pass, `search/flat_kernel.py`, and its bounds invert these terms to
count replicas; they say so where they do.) `Input*` sources cost nothing (data loading).

O is priced at the wire precision (graph/precision.py): under a bf16 profile a float32 boundary
tensor counts half (it crosses as bf16), while activation (stash) bytes count what is held. An fp32
profile prices every byte as before, bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.hierarchy import Level
from model_parallel.graph.plan import Plan
from model_parallel.graph.precision import precision_of, wire_bytes


@dataclass(frozen=True)
class StageCost:
    """Sums over one stage's nodes: compute seconds, parameter and activation bytes (held), bytes in and
    out (as they cross: at the wire precision)."""

    compute_s: float
    parameter_bytes: float
    activation_bytes: float
    input_bytes: float
    output_bytes: float


def allreduce_seconds(parameters: Any, replicas: Any, bandwidth: float, within: Any = 1) -> Any:
    """PipeDream's weight synchronisation of a stage replicated `replicas` times: `4 (r-1) W / (B r) / g`."""
    return (4 * (replicas - 1) * parameters) / (bandwidth * replicas) / within


def stage_seconds(compute: Any, parameters: Any, replicas: Any, bandwidth: float, within: Any = 1, pace: Any = None) -> Any:
    """A replicated stage's seconds per minibatch: `(T + all-reduce) / pace`, pace = r (the replicas share
    the microbatches round-robin), or r times their slowest speed when workers differ."""
    return (compute + allreduce_seconds(parameters, replicas, bandwidth, within)) / (replicas if pace is None else pace)


def transfer_seconds(bytes_: Any, bandwidth: float, replicas: Any, ratio: float) -> Any:
    """Sending (and receiving) activations across a cut: `2 O / (B r) / R` (PipeDream counts both ways)."""
    return (2.0 * bytes_) / (bandwidth * replicas) / ratio


def data_parallel_seconds(compute: Any, parameters: Any, levels: Sequence[Level]) -> Any:
    """PipeDream's time of one stage replicated on every machine of `levels` (innermost first): at each
    level `(t + 4 (M - 1) P / (B M) / M_inside) / M`. Works elementwise on numpy arrays."""
    time, within = compute, 1
    for level in levels:
        n = level.num_machines
        time = stage_seconds(time, parameters, n, level.bandwidth, within)
        within = n
    return time


def stage_costs(graph: Graph, stage_of: dict[str, int], num_stages: int, precision: Optional[str] = None) -> list[StageCost]:
    """Costs of every stage; a value crossing several boundaries counts at each (it is passed through).
    Boundary bytes at `precision` (None: the one the graph was profiled at, `precision_of`)."""
    precision = precision_of(graph) if precision is None else precision
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
        sent = wire_bytes(node, precision) if last > stage else 0.0
        for boundary in range(stage, last):  # live across the cut after `boundary`
            outputs[boundary] += sent
            inputs[boundary + 1] += sent
    return [StageCost(*values) for values in zip(compute, params, acts, inputs, outputs)]


def predict_stage_times(
    graph: Graph,
    plan: Plan,
    worker_speeds: Optional[Sequence[float]] = None,
    bandwidth: float = 1e9,
    activation_compression_ratio: Optional[float] = None,
) -> tuple[float, ...]:
    """Predicted seconds per minibatch of each stage of `plan` on workers of the given speeds.

    Stage time = max(`stage_seconds` at r times the slowest speed of its ranks, `transfer_seconds` in and
    out), the transfers only with a compression ratio R (as PipeDream).
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
        time = stage_seconds(cost.compute_s, cost.parameter_bytes, r, bandwidth, pace=speed)
        if activation_compression_ratio is not None:
            time = max(time, transfer_seconds(cost.input_bytes, bandwidth, r, activation_compression_ratio))
            if stage.stage_id < plan.num_stages - 1:
                time = max(time, transfer_seconds(cost.output_bytes, bandwidth, r, activation_compression_ratio))
        times.append(time)
    return tuple(times)


def stage_transfers(
    cost: StageCost, levels: Sequence[Level], replicas: Sequence[int], before: Optional[int], after: Optional[int],
    ratio: float,
) -> float:
    """The largest communication term of a stage in a hierarchical plan: the all-reduce of its weights among
    its replicas at each level (divided by the machines inside), and its activations over the level that
    splits the boundary before it (`before`) and after it (`after`; None where there is none)."""
    transfers, within = [0.0], 1
    for level, count in zip(levels, replicas):
        transfers.append(allreduce_seconds(cost.parameter_bytes, count, level.bandwidth, within))
        within *= level.num_machines
    for level, bytes_ in ((before, cost.input_bytes), (after, cost.output_bytes)):
        if level is not None:
            transfers.append(transfer_seconds(bytes_, levels[level].bandwidth, replicas[level], ratio))
    return max(transfers)
