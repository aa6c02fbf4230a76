"""Tied parameters: one tensor under several names, kept one tensor in every stage that holds it.

GPT-2, BERT-MLM and OPT share the input embedding's weight with the output layer. The profiler
records such names by identity (`Graph.tie_groups()`, e.g. `("transformer.wte.weight",
"lm_head.weight")`). A node *uses* a name when it runs the module holding it (a call_module whose
target is a prefix of the name) or reads it (a get_attr of the name). A get_attr of a parameter
that a module also holds (`F.linear(x, self.wte.weight)`) is a tie as well, with a single name.

Rebuilding a stage creates each layer separately, so a tie must be restored explicitly: in memory
(`tie_stage`, called by `codegen.build`) and in generated code (`tie_lines`). The users of one tie
on different stages would be separate copies whose gradients are never summed; until the runtime
sums them, `check_ties` refuses such a plan instead of training silently apart.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from model_parallel.codegen.naming import layer_name
from model_parallel.errors import CodegenError, TiedParameterError
from model_parallel.graph.core import Graph, Node


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


def _attribute_path(node: Node, name: str) -> Optional[str]:
    """Where a stage module holds `name` when it contains `node`, or None if the node does not use it."""
    layer = node.layer
    if layer is None:
        return None
    if layer.op == "call_module" and name.startswith(layer.target + "."):
        return layer_name(layer.target) + name[len(layer.target):]
    if layer.op == "get_attr" and name == layer.target:
        return layer_name(layer.target)
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
                path = _attribute_path(node, name)
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
    from model_parallel.codegen.naming import state_key

    owned = {state_key(name, owner=n.layer.target) for n in graph.nodes if n.layer is not None for name in n.layer.parameters}
    aliases = {}
    for tie in find_ties(graph):
        paths = list(dict.fromkeys(path for _, path in tie.users))
        keys = [path for path in paths if path in owned]
        if keys:
            aliases.update({path: keys[0] for path in paths if path not in owned})
    return aliases


# ---- refusing a split tie ---------------------------------------------------------------------------
def _fix(tie: Tie) -> str:
    nodes = " and ".join(tie.node_ids)
    return ("Summing the gradients of tied parameters across stages is not supported yet (coming: one logical "
            "parameter per tie, as Megatron and DeepSpeed keep embeddings). Until then put nodes "
            f"{nodes} in one stage (for a contiguous split that is every node between them too, e.g. a "
            "single-stage plan), or untie them in the model (e.g. tie_word_embeddings=False in a Hugging Face "
            "config, or give the output layer its own Parameter) and profile it again")


def _describe(tie: Tie) -> str:
    if len(tie.names) > 1:
        return f"tied parameters {' and '.join(repr(n) for n in tie.names)} are one tensor in the model"
    return f"parameter {tie.names[0]!r} is used by several nodes"


def check_ties(graph: Graph, stage_of: Mapping[str, int]) -> None:
    """Refuse a node -> stage assignment that puts the users of one tied tensor on different stages."""
    for tie in find_ties(graph):
        stages = {node_id: int(stage_of[node_id]) for node_id in tie.node_ids if node_id in stage_of}
        if len(set(stages.values())) > 1:
            where = ", ".join(f"node {n} on stage {s}" for n, s in stages.items())
            raise TiedParameterError(
                f"{_describe(tie)}, but the plan splits its users ({where}); separate copies on different "
                f"stages would silently train apart. {_fix(tie)}"
            )


def check_stage_ties(graph: Graph, node_ids: Iterable[str]) -> None:
    """Refuse a stage holding some users of a tied tensor but not all of them."""
    members = set(node_ids)
    for tie in find_ties(graph):
        inside = [n for n in tie.node_ids if n in members]
        outside = [n for n in tie.node_ids if n not in members]
        if inside and outside:
            raise TiedParameterError(
                f"{_describe(tie)}, but this stage holds node(s) {', '.join(inside)} without "
                f"{', '.join(outside)}; separate copies on different stages would silently train apart. {_fix(tie)}"
            )


# ---- keeping a tie within a stage ---------------------------------------------------------------------
def _stage_paths(tie: Tie, node_ids: Iterable[str]) -> list[str]:
    """Distinct attribute paths of the tie in a stage holding `node_ids`, the canonical one first."""
    members = set(node_ids)
    return list(dict.fromkeys(path for node_id, path in tie.users if node_id in members))


def _split(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    module_path, _, leaf = path.rpartition(".")
    try:
        return (root.get_submodule(module_path) if module_path else root), leaf
    except AttributeError as error:
        raise CodegenError(f"tied tensor {path!r}: the stage has no such module ({error})") from None


def _get(root: nn.Module, path: str) -> torch.Tensor:
    owner, leaf = _split(root, path)
    tensor = getattr(owner, leaf, None)
    if not isinstance(tensor, torch.Tensor):
        raise CodegenError(f"tied tensor {path!r}: the stage's {type(owner).__name__} has no tensor {leaf!r}")
    return tensor


def _set(root: nn.Module, path: str, tensor: torch.Tensor) -> None:
    owner, leaf = _split(root, path)
    # Drop the old registration first: a parameter may replace a buffer (an uninitialised get_attr) or back.
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)


def tie_stage(graph: Graph, node_ids: Sequence[str], root: nn.Module) -> None:
    """Point every attribute of a tie in `root` (a stage being built from `node_ids`) at one tensor."""
    for tie in find_ties(graph):
        paths = _stage_paths(tie, node_ids)
        if len(paths) < 2:
            continue
        canonical = _get(root, paths[0])
        for path in paths[1:]:
            current = _get(root, path)
            if current is canonical:
                continue  # layers handed over from the original model are tied already
            if current.shape != canonical.shape:
                raise CodegenError(
                    f"{_describe(tie)} but have different shapes in the rebuilt stage ({paths[0]} "
                    f"{tuple(canonical.shape)}, {path} {tuple(current.shape)}); the graph does not match the model"
                )
            _set(root, path, canonical)


def _expression(path: str) -> str:
    """`self.lm_head.weight`, or `self.get_submodule("seq.0").weight` where a part is not an identifier."""
    module_path, _, leaf = path.rpartition(".")
    if all(part.isidentifier() for part in path.split(".")):
        return f"self.{path}"
    return f"self.get_submodule({module_path!r}).{leaf}"


def tie_lines(graph: Graph, node_ids: Sequence[str]) -> list[str]:
    """Statements for a generated stage's `__init__` (after the layers are built) that restore its ties."""
    lines = []
    for tie in find_ties(graph):
        paths = _stage_paths(tie, node_ids)
        for path in paths[1:]:
            lines.append(f"{_expression(path)} = {_expression(paths[0])}  # tied: one tensor ({', '.join(tie.names)})")
    return lines
