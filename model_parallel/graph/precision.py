"""The precision a profile was timed at and a plan was priced at, and the bytes a node's outputs cross a cut with.

Two precisions: "fp32" (everything float32) and "bf16" (forwards under bf16 autocast, float32 master
weights; the runtime's `TrainConfig.bf16`). Under bf16 a boundary value travels narrowed: a float32
output (a residual stream, a LayerNorm or softmax output, which autocast keeps in float32) crosses
as bf16, half its bytes, while one autocast already made bf16 (a Linear's output) crosses as it is
(runtime/wire/structure.py `narrowed`). What a stage *holds* (stash, memory) is the dtype the node
produced: `Node.activation_size`, recorded by the profiler at the profiled precision. What *crosses*
is `wire_bytes`.

The profile records its precision in `graph.metadata["profile"]["precision"]` (absent: fp32, as
every profile before it was), the plan in `plan.extra["precision"]`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from model_parallel.errors import ConfigError
from model_parallel.graph.core import Graph, Node

PRECISIONS = ("fp32", "bf16")
WIRE_DTYPE = {"fp32": None, "bf16": torch.bfloat16}  # what wider floating-point boundary values travel as


def check_precision(precision: str, where: str = "precision") -> str:
    """`precision` itself, or a ConfigError naming `where` and the choices."""
    if precision not in PRECISIONS:
        raise ConfigError(f"{where} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def precision_of(graph: Graph) -> str:
    """The precision the graph's profile was timed at (fp32 when it records none)."""
    profile = graph.metadata.get("profile")
    found = profile.get("precision", "fp32") if isinstance(profile, Mapping) else "fp32"
    return found if found in PRECISIONS else "fp32"


def _dtype(name: str) -> Optional[torch.dtype]:
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


def _wire_ratio(dtype_name: str, wire: Optional[torch.dtype]) -> float:
    """Bytes on the wire per byte held for a tensor of `dtype_name` (the rule of structure.narrowed)."""
    dtype = _dtype(dtype_name)
    if wire is None or dtype is None or not dtype.is_floating_point:
        return 1.0
    return min(1.0, wire.itemsize / dtype.itemsize)


def wire_bytes(node: Node, precision: str = "fp32") -> float:
    """Bytes of `node`'s outputs on a stage boundary at `precision`.

    fp32: `node.activation_bytes` itself (bit for bit: the PipeDream cost model's numbers do not move).
    bf16: each floating-point output wider than bf16 counts at bf16 size. The outputs' dtypes come
    from `node.layer.outputs`; a node without them (a PipeDream graph.txt) keeps its bytes as they are,
    since nothing says which of them are float32."""
    wire = WIRE_DTYPE[check_precision(precision)]
    metas = node.layer.outputs if node.layer is not None else ()
    if wire is None or not metas:
        return node.activation_bytes
    sizes = node.activation_sizes
    if len(sizes) == len(metas):  # one size per output: scale each by its own dtype
        return float(sum(size * _wire_ratio(meta.dtype, wire) for size, meta in zip(sizes, metas)))
    # One total for several outputs: split it by what each output holds.
    held = [meta.numel * ((_dtype(meta.dtype) or torch.float32).itemsize) for meta in metas]
    if sum(held) <= 0:
        return node.activation_bytes
    return node.activation_bytes * sum(h * _wire_ratio(m.dtype, wire) for h, m in zip(held, metas)) / sum(held)


def plan_precision(plan: Any, graph: Optional[Graph] = None) -> Optional[str]:
    """The precision `plan` was priced at: its own record, else its graph's profile's when the graph
    was profiled (a timed graph prices at the precision it was timed at); None when neither says."""
    extra = getattr(plan, "extra", None) or {}
    if extra.get("precision") in PRECISIONS:
        return str(extra["precision"])
    if graph is not None and isinstance(graph.metadata.get("profile"), Mapping):
        return precision_of(graph)
    return None


def precision_mismatch(plan: Any, graph: Optional[Graph], bf16: bool) -> Optional[str]:
    """A warning when a run at `bf16` uses a plan priced at the other precision (None when they agree
    or the plan says nothing): its stage balance was computed for other compute and wire costs."""
    priced = plan_precision(plan, graph)
    running = "bf16" if bf16 else "fp32"
    if priced is None or priced == running:
        return None
    flag = "--bf16" if bf16 else "no --bf16"
    return (f"this run trains at {running} ({flag}) but the plan was priced at {priced}: its stage times and "
            f"boundary bytes are for {priced}, so the stages may be unbalanced; profile at {running} "
            f"(model_parallel.profile(..., precision={running!r}) / profiler --bf16) and partition again, "
            f"or run {'without' if bf16 else 'with'} --bf16")
