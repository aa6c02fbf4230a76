"""Tied parameters: one tensor under several names, kept one tensor in every stage that holds it.

GPT-2, BERT-MLM and OPT share the input embedding's weight with the output layer. The profiler
records such names by identity (`Graph.tie_groups()`, e.g. `("transformer.wte.weight",
"lm_head.weight")`). A node *uses* a name when it runs the module holding it (a call_module whose
target is a prefix of the name) or reads it (a get_attr of the name). A get_attr of a parameter
that a module also holds (`F.linear(x, self.wte.weight)`) is a tie as well, with a single name.

Rebuilding a stage creates each layer separately, so a tie must be restored explicitly: in memory
(`tie_stage` within a stage, `tie_stages` across the stages one process builds, both called by
`codegen.build`) and in generated code (`tie_lines`). The users of one tie on stages in different
processes are copies: the runtime keeps them one logical parameter (runtime/build/tied.py sums their
gradients). A path that cannot do that (a generated package run by PipeDream's runtime, the
asynchronous pipedream schedule) calls `check_ties`, which refuses such a plan naming the tie,
instead of letting the copies train silently apart.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import torch
from torch import nn

from model_parallel.codegen.naming import Tie, find_ties
from model_parallel.errors import CodegenError, TiedParameterError
from model_parallel.graph.core import Graph


# ---- refusing a split tie where it cannot be honoured ------------------------------------------------
def _fix(tie: Tie) -> str:
    nodes = " and ".join(tie.node_ids)
    return (f"Put nodes {nodes} in one stage (for a contiguous split that is every node between them too, e.g. a "
            "single-stage plan), or untie them in the model (e.g. tie_word_embeddings=False in a Hugging Face "
            "config, or give the output layer its own Parameter) and profile it again")


def _describe(tie: Tie) -> str:
    if len(tie.names) > 1:
        return f"tied parameters {' and '.join(repr(n) for n in tie.names)} are one tensor in the model"
    return f"parameter {tie.names[0]!r} is used by several nodes"


def split_ties(graph: Graph, stage_of: Mapping[str, int]) -> list[tuple[Tie, dict[str, int]]]:
    """Every tie whose users `stage_of` puts on two or more stages, with its users' stages."""
    found = []
    for tie in find_ties(graph):
        stages = {node_id: int(stage_of[node_id]) for node_id in tie.node_ids if node_id in stage_of}
        if len(set(stages.values())) > 1:
            found.append((tie, stages))
    return found


def check_ties(graph: Graph, stage_of: Mapping[str, int], reason: str) -> None:
    """Refuse a node -> stage assignment that splits the users of one tied tensor, on a path that cannot
    keep the copies one parameter; `reason` says why this path cannot (it ends the message's middle)."""
    for tie, stages in split_ties(graph, stage_of):
        where = ", ".join(f"node {n} on stage {s}" for n, s in stages.items())
        raise TiedParameterError(
            f"{_describe(tie)}, but the plan splits its users ({where}) and {reason}, so the copies would "
            f"silently train apart. {_fix(tie)}"
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


def tie_stages(graph: Graph, stages: Sequence[nn.Module]) -> None:
    """Point the attributes of every tie split across `stages` (built in one process, e.g. by
    `build_stages` from fresh layers) at the first stage's tensor: one Parameter, as in the model."""
    for tie in find_ties(graph):
        held = [(stage, path) for stage in stages for path in _stage_paths(tie, getattr(stage, "node_ids", ()))]
        if len({id(stage) for stage, _ in held}) < 2:
            continue
        canonical = _get(held[0][0], held[0][1])
        for stage, path in held[1:]:
            current = _get(stage, path)
            if current is not canonical:
                if current.shape != canonical.shape:
                    raise CodegenError(f"{_describe(tie)} but have different shapes in the rebuilt stages "
                                       f"({tuple(canonical.shape)}, {path} {tuple(current.shape)}); the graph does "
                                       "not match the model")
                _set(stage, path, canonical)


def _expression(path: str) -> str:
    """`self.lm_head.weight`, or `self.get_submodule("seq.0").weight` where a part is not an identifier."""
    module_path, _, leaf = path.rpartition(".")
    if all(part.isidentifier() for part in path.split(".")):
        return f"self.{path}"
    return f"self.get_submodule({module_path!r}).{leaf}"


def _comment_names(tie: Tie) -> str:
    """The tie's names for a source comment: a name from the file with a line break or control character
    would end the comment and start code, so such a name is printed as its repr()."""
    return ", ".join(n if n.isprintable() else repr(n) for n in tie.names)


def tie_lines(graph: Graph, node_ids: Sequence[str]) -> list[str]:
    """Statements for a generated stage's `__init__` (after the layers are built) that restore its ties."""
    lines = []
    for tie in find_ties(graph):
        paths = _stage_paths(tie, node_ids)
        for path in paths[1:]:
            lines.append(f"{_expression(path)} = {_expression(paths[0])}  # tied: one tensor ({_comment_names(tie)})")
    return lines
