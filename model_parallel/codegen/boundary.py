"""What each stage receives and sends: the values that cross stage boundaries, passed neighbour to neighbour.

For a stage assignment, stage k's inputs are the model inputs it holds plus the values produced in
stages < k and consumed in stages >= k (model outputs count as consumed after the last stage);
its outputs are the values produced in stages <= k and consumed in stages > k, plus the model
outputs on the last stage. A value needed several stages down is passed through the stages in
between, so every stage talks only to its neighbours. Names are node ids in topological order.

    stage:        0        1        2
    x ---------> conv -> relu ----> add      (x is passed through stage 1)
    boundary:  in (x)   in (conv,x) in (relu,x)
               out(conv,x) out(relu,x) out(add)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from model_parallel.errors import PlanError
from model_parallel.graph.arguments import referenced_nodes
from model_parallel.graph.core import Graph, Node


@dataclass(frozen=True)
class StageBoundary:
    """Names (node ids) of the values a stage takes, in order, and of the values it returns, in order."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def is_model_input(node: Node) -> bool:
    """A model input (fx placeholder, or PipeDream's `Input...` source)."""
    if node.layer is not None:
        return node.layer.op == "placeholder"
    return node.is_input


def model_output_ids(graph: Graph) -> tuple[str, ...]:
    """Node ids of the model outputs (`graph.metadata["outputs"]`, else the sinks), in topological order."""
    encoded = graph.metadata.get("outputs")
    ids = set(referenced_nodes(encoded)) if encoded is not None else set(graph.sinks)
    unknown = sorted(i for i in ids if i not in graph)
    if unknown:
        raise PlanError(f"graph metadata names model output(s) {unknown} that are not nodes of the graph")
    return tuple(n for n in graph.topological_order if n in ids)


def check_stage_assignment(graph: Graph, stage_of: Mapping[str, int]) -> int:
    """Validate a node -> stage map (every node, stages >= 0, no edge going back); returns the stage count."""
    missing = [n.node_id for n in graph.nodes if n.node_id not in stage_of]
    if missing:
        raise PlanError(f"no stage given for {len(missing)} node(s), e.g. {missing[:3]}; every node needs a stage")
    unknown = sorted(n for n in stage_of if n not in graph)
    if unknown:
        raise PlanError(f"stage assignment names node(s) not in the graph, e.g. {unknown[:3]}")
    for node_id, stage in stage_of.items():
        if int(stage) < 0:
            raise PlanError(f"node {node_id} is assigned stage {stage}; stages are numbered from 0")
    for src, dst in graph.edges:
        if stage_of[src] > stage_of[dst]:
            raise PlanError(
                f"edge {src} -> {dst} goes from stage {stage_of[src]} back to stage {stage_of[dst]}; "
                f"a pipeline only sends values forward: move {dst} to stage >= {stage_of[src]} "
                f"or {src} to stage <= {stage_of[dst]}"
            )
    return max(int(s) for s in stage_of.values()) + 1


def stage_boundaries(graph: Graph, stage_of: Mapping[str, int]) -> tuple[StageBoundary, ...]:
    """The boundary of every stage 0..S-1 for the assignment `stage_of` (node id -> stage)."""
    num_stages = check_stage_assignment(graph, stage_of)
    outputs = set(model_output_ids(graph))
    inputs_of: list[list[str]] = [[] for _ in range(num_stages)]
    outputs_of: list[list[str]] = [[] for _ in range(num_stages)]
    for node_id in graph.topological_order:
        produced = int(stage_of[node_id])
        consumers = [int(stage_of[c]) for c in graph.successors[node_id]]
        last_use = max(consumers, default=produced)
        if node_id in outputs:
            last_use = num_stages  # the loss (after the last stage) consumes model outputs
        if is_model_input(graph[node_id]):
            inputs_of[produced].append(node_id)
        if min(last_use, num_stages - 1) > produced and not graph[node_id].crossable:
            why = graph[node_id].uncrossable or "a weight read as a bare tensor stays with its readers"
            raise PlanError(
                f"the plan sends node {node_id}'s value from stage {produced} to stage {min(last_use, num_stages - 1)}, "
                f"but it cannot cross a stage boundary ({why}); put {node_id} and its "
                f"consumers ({', '.join(graph.successors[node_id]) or 'the loss'}) in one stage"
            )
        for stage in range(produced + 1, min(last_use, num_stages - 1) + 1):
            inputs_of[stage].append(node_id)
        for stage in range(produced, min(last_use, num_stages)):
            outputs_of[stage].append(node_id)
    return tuple(StageBoundary(tuple(i), tuple(o)) for i, o in zip(inputs_of, outputs_of))
