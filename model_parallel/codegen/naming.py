"""Stable names for layers and parameters in stage modules, whatever the partition.

A stage holds each layer as one attribute named `graph.attribute_names[target]` (`layer_name(target)`,
fx's own convention: dots become underscores, unless two targets or a reserved name clash; see
`graph.names`), so the state-dict key of the original parameter `layer1.0.conv1.weight` is
`layer1_0_conv1.weight` in whichever stage holds it. Checkpoints, optimizer state and layer
migration key on these names, which is why they must not depend on the stage boundaries.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from model_parallel.errors import CodegenError
from model_parallel.graph.core import STATE_ALIASES, Graph, Node
from model_parallel.graph.names import layer_name  # noqa: F401 - re-exported: one owner, graph.names


def state_key(original_key: str, owner: Optional[str] = None, attribute: Optional[str] = None) -> str:
    """`"layer1.0.conv1.weight"` -> `"layer1_0_conv1.weight"`.

    `owner` is the module (or attribute) path that owns the key in the original model; it matters
    for leaf modules with submodules (`attn.out_proj.weight` owned by `attn` -> `attn.out_proj.weight`)
    and for bare attribute tensors (`pos.emb` owned by `pos.emb` -> `pos_emb`). Without it the last
    component is taken as the parameter name. `attribute`: the owner's attribute in a stage
    (`graph.attribute_names[owner]`), default `layer_name(owner)`.
    """
    if owner is not None:
        attribute = layer_name(owner) if attribute is None else attribute
        if original_key == owner:
            return attribute
        if not original_key.startswith(owner + "."):
            raise CodegenError(f"state key {original_key!r} does not belong to {owner!r}")
        return attribute + original_key[len(owner):]
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
            new = state_key(key, owner=node.layer.target, attribute=graph.attribute_names.get(node.layer.target))
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
    aliases = graph.metadata.get(STATE_ALIASES) or {}  # another name of a tensor a node owns: same value
    result: dict[str, Any] = {}
    for key, value in state_dict.items():
        if key in mapping:
            result[mapping[key]] = value
        elif key in aliases and aliases[key] in mapping:
            continue
        elif strict:
            raise CodegenError(
                f"state dict key {key!r} is not owned by any node of the graph; "
                "is it the state of another model? (pass strict=False to drop unknown keys)"
            )
    missing = [key for key in mapping if key not in state_dict]
    if strict and missing:
        raise CodegenError(f"state dict lacks {len(missing)} parameter(s) the graph owns, e.g. {missing[:3]}")
    result.update({alias: result[key] for alias, key in tie_aliases(graph).items() if key in result})
    return result


def original_state_from_stage(graph: Graph, stage_state: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `stage_state_from_original`: stage keys (from any number of stages) -> original keys."""
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
    for alias, owned in (graph.metadata.get(STATE_ALIASES) or {}).items():
        if owned in result:  # the original model's state dict lists the tensor under both names
            result[alias] = result[owned]
    return result


# ---- tied tensors (several names or attributes, one tensor) ------------------------------------------
@dataclass(frozen=True)
class Tie:
    """One tensor of the original model and the nodes using it.

    `names`: its original state-dict names. `users`: (node id, attribute path in a stage module,
    e.g. `"lm_head.weight"` or `"wte_weight"`), owners first, then in topological order; the first
    user's tensor is the one every other attribute is pointed at.
    """

    names: tuple[str, ...]
    users: tuple[tuple[str, str], ...]

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(node_id for node_id, _ in self.users))


def _attribute_path(graph: Graph, node: Node, name: str) -> Optional[str]:
    """Where a stage module holds `name` when it contains `node`, or None if the node does not use it."""
    layer = node.layer
    if layer is None:
        return None
    if layer.op == "call_module" and name.startswith(layer.target + "."):
        return graph.attribute_names[layer.target] + name[len(layer.target):]
    if layer.op == "get_attr" and name == layer.target:
        return graph.attribute_names[layer.target]
    return None


def _shared_reads(graph: Graph, grouped: set[str]) -> list[tuple[str, ...]]:
    """Single-name ties: get_attr nodes reading a tensor that a module node (or another node) also holds."""
    module_targets = {n.layer.target for n in graph.nodes if n.layer is not None and n.layer.op == "call_module"}
    reads: dict[str, int] = {}
    for node in graph.nodes:
        if node.layer is not None and node.layer.op == "get_attr":
            reads[node.layer.target] = reads.get(node.layer.target, 0) + 1
    found = []
    for target, count in reads.items():
        parts = target.split(".")
        held_by_module = any(".".join(parts[:i]) in module_targets for i in range(1, len(parts)))
        if target not in grouped and (held_by_module or count > 1):
            found.append((target,))
    return found


def find_ties(graph: Graph) -> tuple[Tie, ...]:
    """Every tensor of `graph` used by two or more nodes under different attributes or names."""
    groups = list(graph.tie_groups())
    groups += _shared_reads(graph, {name for group in groups for name in group})
    if not groups:
        return ()
    position = {node_id: i for i, node_id in enumerate(graph.topological_order)}
    ties = []
    for names in groups:
        users = []
        for node in graph.nodes:
            owns = node.layer is not None and any(name in node.layer.parameters for name in names)
            for name in names:
                path = _attribute_path(graph, node, name)
                if path is not None:
                    users.append((not owns, position[node.node_id], node.node_id, path))
        users.sort()
        tie = Tie(names=tuple(names), users=tuple((node_id, path) for _, _, node_id, path in users))
        if len({path for _, path in tie.users}) > 1 or len(tie.node_ids) > 1:
            ties.append(tie)
    return tuple(ties)


def tie_aliases(graph: Graph) -> dict[str, str]:
    """Stage state keys that name a tied tensor no node owns under that key -> the owned key they repeat.

    A get_attr of a module's parameter (`wte_weight` reading `wte.weight`) is such an alias: the
    original state dict has only `wte.weight`, a stage holding both has both keys.
    """
    owned = {state_key(name, owner=n.layer.target, attribute=graph.attribute_names.get(n.layer.target))
             for n in graph.nodes if n.layer is not None for name in n.layer.parameters}
    aliases = {}
    for tie in find_ties(graph):
        paths = list(dict.fromkeys(path for _, path in tie.users))
        keys = [path for path in paths if path in owned]
        if keys:
            aliases.update({path: keys[0] for path in paths if path not in owned})
    return aliases
