"""The one contiguous partitioner: p stages over one topological order, stage k on worker k.

The straight solver (`straight.py`, through `partition`'s one-level fast path) with the given worker
speeds, or unit speeds for an "even" split. Nodes are priced by their profiled time (`compute_ms`)
and nothing else; a graph without any timings (traced, not profiled) counts every node alike, so the
split is even by node count rather than by a mix of bytes and milliseconds.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Optional

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Hierarchy, Plan
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition


def _timed(graph: Graph) -> Graph:
    """`graph`, or with 1 ms on every node when no node carries a time (nothing to balance otherwise)."""
    if any(node.compute_ms > 0 for node in graph.nodes):
        return graph
    # (The metadata stays: its model outputs tell side effects apart, see optimizer/workload.py.)
    return graph.replace_nodes(replace(node, forward_ms=1.0) for node in graph.nodes)


def straight_plan(graph: Graph, ranks: Sequence[int], speeds: Optional[Sequence[float]] = None) -> Plan:
    """`len(ranks)` contiguous stages, stage k on `ranks[k]`, minimising the slowest `compute / speed_k`
    (exact over one topological order; ties take the earliest cut). Model inputs land in stage 0."""
    layers = sum(1 for node in graph.nodes if not (node.is_input and not graph.predecessors[node.node_id]))
    if not 1 <= len(ranks) <= layers:
        raise PlanError(
            f"cannot split {layers} layer node(s) into {len(ranks)} stage(s); choose 1..{layers} stages (workers)"
        )
    speeds = tuple(float(s) for s in speeds) if speeds is not None else (1.0,) * len(ranks)
    if len(speeds) != len(ranks):
        raise PlanError(f"got {len(speeds)} speed(s) for {len(ranks)} worker(s); give one speed per worker")
    options = PartitionOptions(straight_pipeline=True, cuts="topological", worker_speeds=speeds)
    plan = partition(_timed(graph), Hierarchy.from_lists([len(ranks)]), options)
    stages = tuple(replace(s, ranks=(int(ranks[i]),)) for i, s in enumerate(plan.stages))
    return replace(plan, stages=stages)


def even_stages(graph: Graph, num_stages: int, replicas: Optional[Mapping[int, int]] = None) -> Plan:
    """`num_stages` contiguous stages of about equal time (the straight solver with unit speeds); ranks in
    stage order, `replicas[k]` of them for stage k (default 1). The default plan of the runtime."""
    replicas = dict(replicas or {})
    unknown = sorted(s for s in replicas if not 0 <= int(s) < num_stages)
    if unknown:
        raise PlanError(f"--stage_to_num_ranks names stage(s) {unknown} but the plan has stages 0..{num_stages - 1}; "
                        "name only existing stages (or raise --num_stages)")
    plan = straight_plan(graph, range(num_stages))
    stages = tuple(replace(s, num_replicas=int(replicas.get(s.stage_id, 1)), ranks=()) for s in plan.stages)
    return replace(plan, stages=stages).with_default_ranks()
