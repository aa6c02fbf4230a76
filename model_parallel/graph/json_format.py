"""graph.json: the richer form of graph.txt, with each node's LayerSpec and the profile's metadata.

    {"schema": "model_parallel.graph", "version": 1, "metadata": {...},
     "nodes": [{"id", "description", "forward_ms", "backward_ms", "activation_size",
                "parameter_size", "stage_id"?, "uncrossable"?, "saved_bytes"?, "layer"?: {"op", "target", "args",
                "kwargs", "module", "outputs": [{"shape", "dtype"}], "parameters"}}],
     "edges": [[src, dst], ...]}

`"uncrossable": "<reason>"` marks a node whose value cannot be sent to another stage (absent: it can;
files written before the field existed read as all crossable). `"saved_bytes"` is what autograd saves
for backward from the node's values (`Node.saved_bytes`; absent: not profiled, the memory model takes
the activation size).

`metadata["tied_parameters"]` ([[name, ...], ...], the state-dict names that are one tensor) is
checked on reading: an unknown name is a GraphFormatError naming the file and the key.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from model_parallel.errors import GraphError, GraphFormatError
from model_parallel.fileio import atomic_write_json, read_json_file
from model_parallel.jsonbound import json_number as _number
from model_parallel.jsonbound import json_typed
from model_parallel.graph.core import Graph, LayerSpec, Node, TensorMeta, too_many
from model_parallel.graph.references import referenced_nodes

SCHEMA = "model_parallel.graph"
VERSION = 1


def layer_to_dict(layer: LayerSpec) -> dict[str, Any]:
    return {
        "op": layer.op,
        "target": layer.target,
        "args": list(layer.args),
        "kwargs": dict(layer.kwargs),
        "module": layer.module,
        "outputs": [{"shape": list(t.shape), "dtype": t.dtype} for t in layer.outputs],
        "parameters": list(layer.parameters),
    }


def _field(data: dict[str, Any], key: str, kind: Union[type, tuple[type, ...]], default: Any, what: str) -> Any:
    """`data[key]` (or `default`) if it is a `kind` (`tuple({"node": "x"})` would read an object as its keys)."""
    return json_typed(data.get(key, default), kind, f"layer {key!r}", what)


def layer_from_dict(data: dict[str, Any]) -> LayerSpec:
    json_typed(data, dict, "a layer", "an object")
    args = _field(data, "args", list, [], "a list")
    kwargs = _field(data, "kwargs", dict, {}, "an object")
    parameters = _field(data, "parameters", list, [], "a list of state-dict names")
    if not all(isinstance(name, str) for name in parameters):
        raise TypeError(f"layer 'parameters' must be a list of state-dict names (strings), got {str(parameters)[:60]!r}")
    for value in (*args, *kwargs.values()):
        referenced_nodes(value)  # a reference whose id is not a string is refused here, with the file and node
    return LayerSpec(
        op=_field(data, "op", str, None, "a string"),
        target=_field(data, "target", str, None, "a string"),
        args=tuple(args),
        kwargs=kwargs,
        module=_field(data, "module", (str, type(None)), None, "a constructor expression or null"),
        outputs=tuple(TensorMeta(tuple(_number(s, "an output shape entry", integer=True) for s in t["shape"]),
                                 str(t["dtype"])) for t in _field(data, "outputs", list, [], "a list")),
        parameters=tuple(parameters),
    )


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    nodes = []
    for node in graph.nodes:
        entry: dict[str, Any] = {
            "id": node.node_id,
            "description": node.description,
            "forward_ms": node.forward_ms,
            "backward_ms": node.backward_ms,
            "activation_size": list(node.activation_size) if isinstance(node.activation_size, tuple) else node.activation_size,
            "parameter_size": node.parameter_size,
        }
        if node.stage_id is not None:
            entry["stage_id"] = node.stage_id
        if node.uncrossable is not None:
            entry["uncrossable"] = node.uncrossable
        if node.saved_bytes is not None:
            entry["saved_bytes"] = node.saved_bytes
        if node.layer is not None:
            entry["layer"] = layer_to_dict(node.layer)
        nodes.append(entry)
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "metadata": dict(graph.metadata),
        "nodes": nodes,
        "edges": [list(e) for e in graph.edges],
    }


def graph_from_dict(data: Any, source: str = "<dict>") -> Graph:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise GraphFormatError(f"{source}: not a model_parallel graph (expected \"schema\": \"{SCHEMA}\")")
    if data.get("version") != VERSION:
        raise GraphFormatError(
            f"{source}: graph schema version {data.get('version')!r} is not supported (this release reads {VERSION})"
        )
    for what in ("nodes", "edges"):  # counted before any node is built
        listed = data.get(what)
        if refused := too_many(len(listed) if isinstance(listed, list) else 0, what):
            raise GraphFormatError(f"{source}: {refused}")
    nodes = []
    try:
        for index, entry in enumerate(data["nodes"]):
            where = f"{source}: nodes[{index}]"
            try:
                activation = entry["activation_size"]
                nodes.append(
                    Node(
                        node_id=str(entry["id"]),
                        description=str(entry["description"]),
                        forward_ms=_number(entry["forward_ms"], "forward_ms"),
                        backward_ms=_number(entry["backward_ms"], "backward_ms"),
                        activation_size=tuple(_number(a, "activation_size") for a in activation)
                        if isinstance(activation, list) else _number(activation, "activation_size"),
                        parameter_size=_number(entry["parameter_size"], "parameter_size"),
                        stage_id=_number(entry["stage_id"], "stage_id", integer=True)
                        if entry.get("stage_id") is not None else None,
                        layer=layer_from_dict(entry["layer"]) if entry.get("layer") else None,
                        uncrossable=entry.get("uncrossable"),
                        saved_bytes=_number(entry["saved_bytes"], "saved_bytes") if entry.get("saved_bytes") is not None else None,
                    )
                )
            except (KeyError, TypeError, ValueError, OverflowError) as error:
                if isinstance(error, GraphError):
                    raise GraphFormatError(f"{where}: {error}") from None
                raise GraphFormatError(f"{where}: malformed node ({type(error).__name__}: {error})") from None
        edges = [(str(a), str(b)) for a, b in data["edges"]]
        metadata = dict(data.get("metadata", {}))
        referenced_nodes(metadata.get("outputs"))  # the model's outputs: references, checked as a layer's are
        return Graph(nodes=tuple(nodes), edges=tuple(edges), metadata=metadata)
    except GraphFormatError:
        raise
    except GraphError as error:
        raise GraphFormatError(f"{source}: {error}") from None
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise GraphFormatError(f"{source}: malformed graph ({type(error).__name__}: {error})") from None


def read_graph_json(path: Union[str, "os.PathLike[str]"]) -> Graph:
    return graph_from_dict(read_json_file(path, GraphFormatError, "graph file"), str(path))


def write_graph_json(graph: Graph, path: Union[str, "os.PathLike[str]"]) -> Path:
    return atomic_write_json(path, graph_to_dict(graph))
