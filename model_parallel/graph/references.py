"""Node references in a layer's encoded arguments, `{"node": "<node id>"}` (graph/arguments.py has the whole
encoding): found and checked here without torch, so reading a graph.json needs none."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_parallel.errors import GraphError


def node_reference_id(payload: Any) -> str:
    """The node id of a reference `{"node": <id>}`: a string (a list or an object there is a malformed file)."""
    if not isinstance(payload, str):
        raise GraphError(f"a node reference is {{\"node\": \"<node id>\"}} (a string naming a node), got "
                         f"{{\"node\": {str(payload)[:60]!r}}}; correct the file or profile the model again")
    return payload


def referenced_nodes(value: Any) -> list[str]:
    """Node ids referenced by an encoded argument, in order of appearance (GraphError for a reference whose id
    is not a string)."""
    found: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for item in v:
                walk(item)
        elif isinstance(v, Mapping):
            if len(v) == 1 and "node" in v:
                found.append(node_reference_id(v["node"]))
            else:
                for item in v.values():
                    walk(item)

    walk(value)
    return found
