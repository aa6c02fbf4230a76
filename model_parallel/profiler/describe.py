"""What a graph records of a traced node besides its dataflow: a PipeDream-style description, a module constructor."""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import _get_qualified_name

from model_parallel.graph.loader import parse_constructor


# ---- descriptions --------------------------------------------------------------------------------
def one_line(text: str) -> str:
    """Collapse a multi-line repr into one line (graph.txt descriptions are single lines)."""
    return " ".join(text.split()).replace(" -- ", " - ")


def _short(value: Any) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_short(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def describe(node: fx.Node, module: Optional[nn.Module], input_index: int) -> str:
    """PipeDream-style description: the module repr, or `Add`, `Concat(1)`, `Flatten(1)`, `View(...)`."""
    if node.op == "placeholder":
        return f"Input{input_index}"
    if node.op == "call_module":
        return one_line(repr(module))
    if node.op == "get_attr":
        return f"Attribute({node.target})"
    constants = [_short(a) for a in node.args if not isinstance(a, fx.Node)]
    constants += [f"{k}={_short(v)}" for k, v in node.kwargs.items() if not isinstance(v, fx.Node)]
    if node.op == "call_function":
        special = {operator.add: "Add", operator.iadd: "Add", operator.mul: "Mul", operator.imul: "Mul",
                   operator.getitem: "__getitem__", torch.cat: "Concat", torch.flatten: "Flatten"}
        name = special.get(node.target) or _get_qualified_name(node.target).replace("_operator.", "operator.")
    else:  # call_method
        name = str(node.target).capitalize() if node.target in ("view", "size", "reshape") else f"Tensor.{node.target}"
    return one_line(f"{name}({', '.join(constants)})")


# ---- module constructors -------------------------------------------------------------------------
def module_constructor(module: nn.Module) -> Optional[str]:
    """An expression that builds an equivalent fresh module, e.g. `torch.nn.Conv2d(3, 64, ...)`.

    Verified by building it and comparing the repr and the parameter shapes; None when the module
    cannot be rebuilt from text (custom modules whose repr is not their constructor).
    """
    cls = type(module)
    if getattr(nn, cls.__name__, None) is cls:
        path = f"torch.nn.{cls.__name__}"
    else:
        path = f"{cls.__module__}.{cls.__qualname__}"
    expression = f"{path}({module.extra_repr()})"
    try:
        # The class is the module's own (this process holds the model); the loader checks the form,
        # so whatever is recorded here is what a loading process would accept.
        constructor = parse_constructor(expression)
        rebuilt = cls(*constructor.args, **constructor.kwargs)
    except Exception:  # any failure just means "not rebuildable from text"
        return None
    if type(rebuilt) is not cls or repr(rebuilt) != repr(module):
        return None
    ours = {k: (tuple(v.shape), v.dtype) for k, v in rebuilt.state_dict().items()}
    theirs = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    return expression if ours == theirs else None
