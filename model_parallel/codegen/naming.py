"""Stable names for layers and parameters in stage modules, whatever the partition.

A stage holds each layer as one attribute named `layer_name(target)` (fx's own convention: dots
become underscores), so the state-dict key of the original parameter `layer1.0.conv1.weight` is
`layer1_0_conv1.weight` in whichever stage holds it. Checkpoints, optimizer state and layer
migration key on these names, which is why they must not depend on the stage boundaries.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from model_parallel.errors import CodegenError
from model_parallel.graph.core import Graph


def layer_name(target: str) -> str:
    """`"layer1.0.conv1"` -> `"layer1_0_conv1"`: the attribute a stage module holds the layer under."""
    name = str(target).replace(".", "_")
    if not name.isidentifier():
        # graph.txt node ids like `5` are not identifiers; a prefix keeps them readable and unique.
        name = "_" + "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return name


def state_key(original_key: str, owner: Optional[str] = None) -> str:
    """`"layer1.0.conv1.weight"` -> `"layer1_0_conv1.weight"`.

    `owner` is the module (or attribute) path that owns the key in the original model; it matters
    for leaf modules with submodules (`attn.out_proj.weight` owned by `attn` -> `attn.out_proj.weight`)
    and for bare attribute tensors (`pos.emb` owned by `pos.emb` -> `pos_emb`). Without it the last
    component is taken as the parameter name.
    """
    if owner is not None:
        if original_key == owner:
            return layer_name(owner)
        if not original_key.startswith(owner + "."):
            raise CodegenError(f"state key {original_key!r} does not belong to {owner!r}")
        return layer_name(owner) + original_key[len(owner):]
    module, dot, leaf = original_key.rpartition(".")
    return f"{layer_name(module)}.{leaf}" if dot else original_key


def state_key_map(graph: Graph) -> dict[str, str]:
    """Original state-dict key -> stage state-dict key, for every parameter/buffer the graph's nodes own.

    Raises `CodegenError` when two original keys would share one stage key
    (e.g. `a.b_c.weight` and `a_b.c.weight`).
    """
    mapping: dict[str, str] = {}
    reverse: dict[str, str] = {}
    for node in graph.nodes:
        if node.layer is None:
            continue
        for key in node.layer.parameters:
            new = state_key(key, owner=node.layer.target)
            other = reverse.get(new)
            if other is not None and other != key:
                raise CodegenError(
                    f"node {node.node_id}: parameters {other!r} and {key!r} both become {new!r} in a stage; "
                    "rename one of the submodules so their paths differ after '.' -> '_'"
                )
            reverse[new] = key
            mapping[key] = new
    return mapping


def stage_state_from_original(graph: Graph, state_dict: Mapping[str, Any], strict: bool = True) -> dict[str, Any]:
    """Rename an original model's state dict to stage keys; load the result into any stage with
    `strict=False`, or into the composed stages / `full_model_from_graph(graph)` with `strict=True`.

    With `strict`, a key the graph does not own, or a graph parameter missing from `state_dict`,
    is a `CodegenError`; otherwise unknown keys are dropped.
    """
    mapping = state_key_map(graph)
    result: dict[str, Any] = {}
    for key, value in state_dict.items():
        if key in mapping:
            result[mapping[key]] = value
        elif strict:
            raise CodegenError(
                f"state dict key {key!r} is not owned by any node of the graph; "
                "is it the state of another model? (pass strict=False to drop unknown keys)"
            )
    missing = [key for key in mapping if key not in state_dict]
    if strict and missing:
        raise CodegenError(f"state dict lacks {len(missing)} parameter(s) the graph owns, e.g. {missing[:3]}")
    from model_parallel.codegen.ties import tie_aliases

    result.update({alias: result[key] for alias, key in tie_aliases(graph).items() if key in result})
    return result


def original_state_from_stage(graph: Graph, stage_state: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `stage_state_from_original`: stage keys (from any number of stages) -> original keys."""
    from model_parallel.codegen.ties import tie_aliases

    reverse = {new: old for old, new in state_key_map(graph).items()}
    aliases = tie_aliases(graph)  # a second key of a tied tensor whose owned key is also there
    result: dict[str, Any] = {}
    for key, value in stage_state.items():
        if key in aliases:
            continue
        if key not in reverse:
            raise CodegenError(
                f"stage state key {key!r} is not a parameter of any graph node; "
                "was it saved from a stage built from another graph?"
            )
        result[reverse[key]] = value
    return result
