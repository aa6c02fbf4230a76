"""Infer layer specs for a plain PipeDream graph.txt (no JSON sidecar) from its node descriptions.

    Input / Input<i>        model input i
    Conv2d(...), ReLU(...)  any torch.nn module repr (old `ReLU(inplace)` style included)
    Add, Add(inplace)       a + b                     Mul              a * b
    Concat(d)               torch.cat(inputs, d)      Flatten(d)       torch.flatten(x, d)
    Size(d)                 x.size(d)                 __getitem__(k)   x[k]
    View(-1)                x.view(x.size(0), -1)     (the batch size comes from a `Size` input when present)

A node's inputs are its in-edges in file order. Module parameters are named `<node_id>.<param>`.
"""
from __future__ import annotations

import ast
import re
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from model_parallel.errors import CodegenError, GraphFormatError
from model_parallel.graph.loader import build_module
from model_parallel.graph.core import Graph, LayerSpec, Node

_CALL = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z_0-9]*)(?:\((?P<args>.*)\))?$")
_INPUT = re.compile(r"^Input(\d*)$")


def _literal_args(text: str, where: str) -> tuple[Any, ...]:
    try:
        value = ast.literal_eval(f"({text},)") if text.strip() else ()
    except (ValueError, SyntaxError):
        raise CodegenError(f"{where}: arguments {text!r} are not literals") from None
    return tuple(value)


def _one_literal(text: str, where: str, form: str, example: str, default: Any = None) -> Any:
    """The single literal argument of `Concat(d)` / `__getitem__(k)` (`default` when none is written and one is
    allowed); any other count is the file's mistake, reported with the form expected."""
    values = _literal_args(text, where)
    if not values and default is not None:
        return default
    if len(values) != 1:
        raise GraphFormatError(f"{where}: {form} takes exactly one literal argument, got {len(values)} "
                               f"({text.strip()!r}); write it like {example}")
    return values[0]


def _module_expression(name: str, args: str, where: str) -> str:
    """`ReLU`, `inplace` -> `torch.nn.ReLU(inplace=True)`: old reprs write bare flags."""
    fixed = ", ".join(
        f"{part.strip()}=True" if part.strip().isidentifier() else part.strip()
        for part in _split_top_level(args)
    )
    return f"torch.nn.{name}({fixed})"


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def _parameter_names(expression: str, where: str) -> tuple[str, ...]:
    try:
        with torch.device("meta"):  # only the names matter: no memory, no initialisation cost
            module = build_module(expression)
    except Exception as error:  # constructor errors of any kind mean "not a buildable description"
        raise CodegenError(f"{where}: cannot build {expression!r}: {error}") from None
    return tuple(name for name, _ in list(module.named_parameters()) + list(module.named_buffers()))


def infer_layer(graph: Graph, node: Node, line: int, input_index: int) -> LayerSpec:
    """The layer a PipeDream description stands for; inputs are the node's in-edges in file order."""
    source = graph.metadata.get("source")
    where = f"{source + ':' if source else 'line '}{line}: node {node.node_id} ({node.description[:60]!r})"
    preds = graph.predecessors[node.node_id]
    refs = [{"node": p} for p in preds]
    text = node.description.strip()
    if _INPUT.match(text):
        return LayerSpec(op="placeholder", target=f"input{input_index}")
    match = _CALL.match(text)
    if match is None:
        raise CodegenError(f"{where}: unrecognised description; expected a torch.nn module repr or one of "
                           "Input, Add, Concat(d), View(-1), Size(d), __getitem__(k)")
    name, args = match.group("name"), match.group("args") or ""

    def need(count: int) -> None:
        if len(preds) != count:
            raise CodegenError(f"{where}: {name} takes {count} input(s) but the node has {len(preds)} in-edge(s)")

    if name in ("Add", "Mul"):
        if len(preds) < 2:
            raise CodegenError(f"{where}: {name} needs at least 2 inputs, the node has {len(preds)} in-edge(s)")
        # Out of place even for `Add(inplace)`: same values, and safe on received activations.
        function = "operator.add" if name == "Add" else "operator.mul"
        if len(preds) == 2:
            return LayerSpec(op="call_function", target=function, args=tuple(refs))
        return LayerSpec(op="call_function", target="builtins.sum" if name == "Add" else "math.prod", args=(refs,))
    if name == "Concat":
        dim = _one_literal(args, where, "Concat(d)", "Concat(1)", default=1)
        return LayerSpec(op="call_function", target="torch.cat", args=(refs, dim))
    if name == "Flatten":
        need(1)
        return LayerSpec(op="call_function", target="torch.flatten", args=(refs[0], *_literal_args(args, where)))
    if name == "Size":
        need(1)
        return LayerSpec(op="call_method", target="size", args=(refs[0], *_literal_args(args, where)))
    if name == "__getitem__":
        need(1)
        index = _one_literal(args, where, "__getitem__(k)", "__getitem__(0)")
        return LayerSpec(op="call_function", target="operator.getitem", args=(refs[0], index))
    if name == "View":
        shape = _literal_args(args, where)
        sizes = [p for p in preds if graph[p].description.startswith("Size")]
        tensors = [p for p in preds if p not in sizes]
        if len(tensors) != 1 or len(sizes) > 1:
            raise CodegenError(f"{where}: View needs one tensor input and at most one Size input, found in-edges {list(preds)}")
        if sizes:
            return LayerSpec(op="call_method", target="view", args=({"node": tensors[0]}, {"node": sizes[0]}, *shape))
        if shape == (-1,):  # x.view(x.size(0), -1) without a Size node: the same as flattening from dim 1
            return LayerSpec(op="call_function", target="torch.flatten", args=({"node": tensors[0]}, 1))
        return LayerSpec(op="call_method", target="view", args=({"node": tensors[0]}, *shape))
    module_class = getattr(nn, name, None)
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise CodegenError(
            f"{where}: {name!r} is not a torch.nn module nor a PipeDream helper op; custom modules (e.g. gnmt's "
            "EmuBidirLSTM, RecurrentAttention) are not supported from graph.txt: profile the model with "
            "model_parallel.profiler to get a graph.json sidecar"
        )
    expression = _module_expression(name, args, where)
    need(1)
    parameters = tuple(f"{node.node_id}.{p}" for p in _parameter_names(expression, where))
    return LayerSpec(op="call_module", target=node.node_id, args=(refs[0],), module=expression, parameters=parameters)


def infer_layers(graph: Graph) -> Graph:
    """A copy of `graph` with a `LayerSpec` on every node that has none, and `metadata["outputs"]`
    (the sinks) when missing."""
    nodes = []
    input_index = 0
    for line, node in enumerate(graph.nodes, start=1):
        if node.layer is None:
            node = replace(node, layer=infer_layer(graph, node, line, input_index))
        if node.layer.op == "placeholder":
            input_index += 1
        nodes.append(node)
    metadata = dict(graph.metadata)
    if "outputs" not in metadata:
        sinks = [{"node": s} for s in graph.sinks]
        metadata["outputs"] = sinks[0] if len(sinks) == 1 else {"tuple": sinks}
    return replace(graph, nodes=tuple(nodes), metadata=metadata)
