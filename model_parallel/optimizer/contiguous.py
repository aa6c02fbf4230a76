"""The one contiguous partitioner: p stages over one topological order, stage k on worker k.

The straight solver (`straight.py`, through `partition`'s one-level fast path) with the given worker
speeds, or unit speeds for an "even" split. Nodes are priced by their profiled time (`compute_ms`)
and nothing else. A graph without any timings (traced, not profiled) is priced by what each stage must
hold: its parameter bytes (gradients and optimizer state are the same multiple of them for every stage),
so a Llama's embedding and LM head, one node each, weigh what they hold; node counts never decide.
Only a graph with neither timings nor parameters counts every node alike.
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


# Parameter-free nodes of an untimed graph weigh this share of the mean parameter node: enough to split
# a parameter-free stretch evenly among ties, too little to move a cut off the parameter balance.
TIE_SHARE = 1e-3


def _priced(graph: Graph) -> Graph:
    """`graph` as the split sees it: a weight read as a bare tensor (get_attr) stays with its reader, and
    with no node timed, each node priced by its parameter bytes in `forward_ms` (1 ms a node when no node
    holds parameters either)."""
    # A cut between a weight and its reader would send the weight (and its gradient back) every microbatch.
    nodes = [replace(node, uncrossable=node.uncrossable or "a weight is read on the stage that holds it")
             if node.reads_state else node for node in graph.nodes]
    if not any(node.compute_ms > 0 for node in nodes):
        holding = [node.parameter_size for node in nodes if node.parameter_size > 0]
        tie = TIE_SHARE * sum(holding) / len(holding) if holding else 0.0
        nodes = [replace(node, forward_ms=(node.parameter_size + tie) / 1e6 if holding else 1.0) for node in nodes]
    # (The metadata stays: its model outputs tell side effects apart, see optimizer/workload.py.)
    return graph.replace_nodes(nodes)


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
    plan = partition(_priced(graph), Hierarchy.from_lists([len(ranks)]), options)
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
