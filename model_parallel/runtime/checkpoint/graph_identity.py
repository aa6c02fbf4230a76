"""What a checkpoint records of the graph it trained, so a resume with another graph is refused (training_record.py).

    describe_graph(graph)         "N nodes, structure HEX": the record's "graph"
    graph_details(folder, graph)  {"graph": what differs}, read off the checkpoint's graph.json when asked

The model fingerprint (resume.fingerprint) covers parameter names, shapes and dtypes only. A GPT-2 with dropout
0.1 has the parameters of one without, but its graph has dropout nodes: resumed with that graph, the run trained
another model and said nothing. The structure is the one ranks agree on (wire/agreement.py `graph_digest`: node
ids, edges, each node's layer; no timings), less the layers' output shapes: a graph re-profiled at another batch
size, or on another machine, is the same model. A plan is not part of it: a live rebalance or another partition
trains the same graph.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

from model_parallel.graph.core import Graph


def describe_graph(graph: Graph) -> str:
    """The graph's node count and structure digest (16 hex digits)."""
    from model_parallel.runtime.wire.agreement import graph_digest

    return f"{len(graph.nodes)} nodes, structure {graph_digest(graph, shapes=False) & (2 ** 64 - 1):016x}"


def graph_details(folder: Union[str, Path], graph: Graph) -> Mapping[str, Callable[[], str]]:
    """What a refusal says of a changed graph: the first difference from the graph checkpoint step directory `folder`
    recorded (read only when the digests differ)."""
    def explain() -> str:
        from model_parallel.runtime.checkpoint.model_files import checkpoint_graph

        try:
            return graph_difference(checkpoint_graph(folder), graph)
        except Exception as error:  # noqa: BLE001 - the refusal stands; only its detail is missing
            return f"the checkpoint's graph is not readable to say where: {str(error).splitlines()[0][:200]}"
    return {"graph": explain}


def graph_difference(old: Graph, new: Graph) -> str:
    """The node counts if they differ, and the first node (or edge) that differs."""
    from model_parallel.runtime.wire.agreement import layer_fields

    said = [f"{len(old.nodes)} -> {len(new.nodes)} nodes"] if len(old.nodes) != len(new.nodes) else []
    for index, (a, b) in enumerate(zip(old.nodes, new.nodes)):
        if a.node_id != b.node_id:
            return "; ".join(said + [f"the first that differs is node #{index + 1}: {a.node_id!r} -> {b.node_id!r}"])
        was, now = layer_fields(a, shapes=False) or {}, layer_fields(b, shapes=False) or {}
        if was != now:
            key = next(k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
            return "; ".join(said + [f"the first that differs is node #{index + 1} {a.node_id!r}: its {key} "
                                     f"{_short(was.get(key))} -> {_short(now.get(key))}"])
    if said:
        longer = old if len(old.nodes) > len(new.nodes) else new
        extra = longer.nodes[min(len(old.nodes), len(new.nodes))].node_id
        return "; ".join(said + [f"node {extra!r} {'removed' if longer is old else 'added'} at the end"])
    edge = next((i for i, (a, b) in enumerate(zip(old.edges, new.edges)) if a != b), min(len(old.edges), len(new.edges)))
    return (f"the edges differ ({len(old.edges)} -> {len(new.edges)}; the first at #{edge + 1}: "
            f"{_edge(old.edges, edge)} -> {_edge(new.edges, edge)})")


def _edge(edges: Any, index: int) -> str:
    return repr(tuple(edges[index])) if index < len(edges) else "none"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
