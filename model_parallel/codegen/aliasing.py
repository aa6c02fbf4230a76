"""Which stage inputs an op modifies in place, directly or through a view (they are cloned on entry:
a received activation is a leaf that requires grad, and autograd forbids modifying one in place).

An alias is also what an op may hand back unchanged: `nn.Identity`, a dropout at p = 0 or in eval mode
(`F.dropout` returns its input itself), timm's DropPath / DropBlock when disabled, `x.to(dtype)` to the
dtype it has. A module without parameters or buffers may be such a pass-through (which one cannot be
told without running it), so it counts as one: at worst an input is cloned that need not be, while
missing one made the stage's first in-place op fail ("a view of a leaf Variable that requires grad is
being used in an in-place operation": timm resnet18's default 7-stage split, a stage from `drop_block`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from torch import nn

from model_parallel.graph import loader
from model_parallel.graph.arguments import referenced_nodes
from model_parallel.graph.core import Graph, LayerSpec

# Operator functions and tensor methods that modify their first argument.
_INPLACE_FUNCTIONS = frozenset(
    f"operator.{name}" for name in (
        "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior",
        "ixor", "ilshift", "irshift", "setitem",
    )
)
# Methods/functions whose result shares memory with their first argument.
_VIEW_OPS = frozenset((
    "view", "view_as", "reshape", "transpose", "permute", "flatten", "squeeze", "unsqueeze", "expand",
    "expand_as", "narrow", "select", "t", "split", "chunk", "unbind", "contiguous", "detach", "unflatten",
    "movedim", "getitem", "unfold", "as_strided", "diagonal",
    # may return the input itself: a conversion to what it already is, a dropout that drops nothing
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "identity",
))


def _may_pass_through(module: Optional[nn.Module]) -> bool:
    """Whether a called module may return its input (or a view of it): one without parameters or buffers
    (Identity, Flatten, a dropout, DropPath); unknown (None): yes."""
    if module is None:
        return True
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def _first_argument(layer: LayerSpec) -> Optional[str]:
    refs = referenced_nodes(layer.args[0]) if layer.args else []
    return refs[0] if refs and isinstance(layer.args[0], Mapping) and "node" in layer.args[0] else None


def _aten_aliasing(layer: LayerSpec) -> Optional[tuple[bool, bool]]:
    """(writes its first argument, returns a view of it) for an ATen operator, from its schema; else None."""
    if layer.op != "call_function" or loader.aten_schema_name(layer.target) is None:
        return None
    op = loader.aten_operator(layer.target)
    if op is None:
        return None
    first = op._schema.arguments[0].alias_info if op._schema.arguments else None
    returns = [r.alias_info for r in op._schema.returns]
    return bool(first is not None and first.is_write), first is not None and any(r is not None for r in returns)


def _is_inplace(layer: LayerSpec, module: Optional[nn.Module]) -> bool:
    aliasing = _aten_aliasing(layer)
    if aliasing is not None:
        return aliasing[0]
    if layer.op == "call_module":
        return bool(getattr(module, "inplace", False))
    if layer.kwargs.get("inplace") is True:
        return True
    if layer.op == "call_function":
        last = layer.target.rpartition(".")[2]
        return layer.target in _INPLACE_FUNCTIONS or (last.endswith("_") and not last.startswith("_"))
    if layer.op == "call_method":
        return layer.target.endswith("_") and not layer.target.startswith("_")
    return False


def mutated_inputs(graph: Graph, node_ids: Sequence[str], inputs: Sequence[str], built: Mapping[str, nn.Module]) -> set[str]:
    """Stage inputs that an op of the stage modifies in place (directly or through a view).

    Such inputs are cloned on entry: a received activation is a leaf that requires grad, and
    autograd forbids modifying one in place. The clone keeps values and gradients identical.
    """
    root = {name: name for name in inputs}
    mutated: set[str] = set()
    for node_id in node_ids:
        layer = graph[node_id].layer
        if layer is None or layer.op == "placeholder":
            continue
        first = _first_argument(layer)
        if first is None or first not in root:
            continue
        inplace = _is_inplace(layer, built.get(node_id))
        aliasing = _aten_aliasing(layer)
        if aliasing is not None:
            view = aliasing[1]
        elif layer.op == "call_module":
            view = _may_pass_through(built.get(node_id))
        else:
            view = layer.op in ("call_method", "call_function") and layer.target.rpartition(".")[2] in _VIEW_OPS
        if view or inplace:  # the result aliases the input: later in-place ops on it modify the input too
            root[node_id] = root[first]
        if inplace:
            mutated.add(root[first])
    return mutated
