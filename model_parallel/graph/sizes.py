"""Size checks before allocation: a tensor a graph file asks for must fit in this host's memory.

A graph file names shapes that become allocations: model inputs (synthetic data), get_attr tensors
and constants (built fresh), module constructors (`torch.nn.Linear(1 << 20, 1 << 20)` is 4 TiB).
Asking the allocator first fails late (after other layers were built), or not at all: Linux
overcommits, and the process is killed while it fills the pages. So each such size is compared with
the host's physical memory first, and refused in one line naming the node and the bytes.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

import torch

from model_parallel.errors import GraphFormatError

GIB = 1 << 30


@lru_cache(maxsize=1)
def host_memory_bytes() -> int:
    """Physical memory of this host (sysconf); 1 TiB where the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 1 << 40


def tensor_bytes(shape: Iterable[Any], dtype: Any) -> int:
    """Exact bytes of a dense tensor of `shape` and `dtype` (a torch.dtype or its name); ValueError for a
    shape that is not a list of non-negative integers or a dtype torch does not know."""
    dims = list(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"shape {str(dims)[:80]} is not a list of non-negative integers")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if not dtype.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {str(dtype)[:40]!r}")
    return math.prod(dims) * dtype.itemsize


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each tensor once), e.g. of one built on meta."""
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def check_module_fits(cls: type, args: tuple, kwargs: dict, where: str, what: str,
                      error: type[Exception] = GraphFormatError) -> None:
    """Refuse a module whose parameters and buffers exceed this host's memory, measured by building it on
    meta (no memory, no initialisation) before it is built for real."""
    try:
        with torch.device("meta"):
            probe = cls(*args, **kwargs)
    except Exception:  # the real construction reports it, with the node
        return
    check_fits(module_bytes(probe), where, what, error)


def check_fits(num_bytes: int, where: str, what: str, error: type[Exception] = GraphFormatError) -> None:
    """Refuse `num_bytes` above this host's physical memory, before anything is allocated."""
    limit = host_memory_bytes()
    if num_bytes > limit:
        raise error(f"{where}: {what} needs {num_bytes / GIB:,.1f} GiB, more than this host's memory "
                    f"({limit / GIB:,.1f} GiB); is the shape in the graph file right? (profile the model again, "
                    "or run it where that memory exists)")


def check_tensor_fits(shape: Any, dtype: Any, where: str, what: str, error: type[Exception] = GraphFormatError) -> None:
    """Refuse a tensor of `shape` and `dtype` (from a file) that is malformed or exceeds this host's memory."""
    try:
        size = tensor_bytes(shape, dtype)
    except (TypeError, ValueError) as problem:
        raise error(f"{where}: {what}: {problem}") from None
    check_fits(size, where, what, error)


def check_graph_sizes(graph: Any, node_ids: Iterable[str]) -> None:
    """The shapes a graph turns into allocations directly: model inputs (metadata and placeholders),
    get_attr tensors and constants, each within this host's memory (GraphFormatError naming it)."""
    inputs = graph.metadata.get("inputs") or []
    for index, entry in enumerate(inputs if isinstance(inputs, list) else []):
        if isinstance(entry, Mapping) and "shape" in entry:
            check_tensor_fits(entry["shape"], entry.get("dtype", "float32"), f"graph metadata 'inputs'[{index}]", "this model input")
    constants = graph.metadata.get("constants") or {}
    for target, record in (constants.items() if isinstance(constants, Mapping) else ()):
        if isinstance(record, Mapping) and isinstance(record.get("shape"), list):
            check_tensor_fits(record["shape"], record.get("dtype"), f"graph metadata 'constants' entry {str(target)[:80]!r}", "this constant")
    for node_id in node_ids:
        layer = graph[node_id].layer
        if layer is not None and layer.op in ("placeholder", "get_attr"):
            for meta in layer.outputs:
                check_tensor_fits(meta.shape, meta.dtype, f"node {node_id}", f"its {layer.op} tensor of shape {list(meta.shape)[:8]}")
