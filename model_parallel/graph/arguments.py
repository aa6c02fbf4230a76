"""JSON encoding of torch.fx node arguments, so a layer's call can be stored in graph.json and rebuilt.

    node reference      {"node": "<node_id>"}
    tuple               {"tuple": [...]}            list -> JSON list
    dict                {"dict": {"key": ...}}      (string keys)
    slice               {"slice": [start, stop, step]}
    torch.dtype         {"dtype": "float32"}
    torch.device        {"device": "cpu"}
    torch.memory_format {"memory_format": "contiguous_format"}
    torch.layout        {"layout": "strided"}
    Ellipsis            {"ellipsis": true}
    None, bool, int, float, str as themselves (inf/nan floats as {"float": "inf"})
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from model_parallel.errors import GraphError

JSONValue = Any
_TYPED = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}


def encode_argument(value: Any, node_name: Callable[[Any], str | None]) -> JSONValue:
    """Encode one argument; `node_name(value)` returns the node id if `value` is a graph node."""
    name = node_name(value)
    if name is not None:
        return {"node": name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [encode_argument(v, node_name) for v in value]}
    if isinstance(value, list):
        return [encode_argument(v, node_name) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise GraphError(f"cannot encode a dict argument with non-string keys: {value!r}")
        return {"dict": {k: encode_argument(v, node_name) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [encode_argument(v, node_name) for v in (value.start, value.stop, value.step)]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if value is Ellipsis:
        return {"ellipsis": True}
    raise GraphError(f"cannot encode argument of type {type(value).__name__}: {value!r}")


def decode_argument(value: JSONValue, resolve_node: Callable[[str], Any]) -> Any:
    """Inverse of `encode_argument`; `resolve_node(node_id)` supplies what a node reference stands for."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode_argument(v, resolve_node) for v in value]
    if isinstance(value, Mapping) and len(value) == 1:
        (kind, payload), = value.items()
        if kind == "node":
            return resolve_node(payload)
        if kind == "tuple" and isinstance(payload, list):
            return tuple(decode_argument(v, resolve_node) for v in payload)
        if kind == "dict" and isinstance(payload, Mapping) and all(isinstance(k, str) for k in payload):
            return {k: decode_argument(v, resolve_node) for k, v in payload.items()}
        if kind == "slice" and isinstance(payload, list) and len(payload) == 3:
            return slice(*(decode_argument(v, resolve_node) for v in payload))
        if kind == "float" and payload in ("inf", "-inf", "nan"):
            return float(payload)
        if kind in ("dtype", "memory_format", "layout"):
            # Only a value of that very type: `{"dtype": "load"}` must not hand over torch.load.
            attr = getattr(torch, payload, None) if isinstance(payload, str) and not payload.startswith("_") else None
            if not isinstance(attr, _TYPED[kind]):
                raise GraphError(f"unknown torch {kind} {str(payload)[:80]!r}")
            return attr
        if kind == "device":
            if not isinstance(payload, (str, int)):
                raise GraphError(f"a device is a string like 'cpu' or 'cuda:0', got {str(payload)[:80]!r}")
            try:
                return torch.device(payload)
            except (RuntimeError, ValueError) as error:
                raise GraphError(f"unknown device {str(payload)[:80]!r}: {error}") from None
        if kind == "ellipsis":
            return Ellipsis
    raise GraphError(f"cannot decode layer argument {value!r}")


def referenced_nodes(value: JSONValue) -> list[str]:
    """Node ids referenced by an encoded argument, in order of appearance."""
    found: list[str] = []

    def walk(v: JSONValue) -> None:
        if isinstance(v, list):
            for item in v:
                walk(item)
        elif isinstance(v, Mapping):
            if len(v) == 1 and "node" in v:
                found.append(v["node"])
            else:
                for item in v.values():
                    walk(item)

    walk(value)
    return found
