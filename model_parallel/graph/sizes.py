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


# Calls that allocate a tensor whose size their literal arguments give (a graph file may ask torch.zeros for 40 GB):
# where the size argument starts (0: the first positional), for functions; methods count after their tensor.
_SIZED_FUNCTIONS = {"zeros": 0, "ones": 0, "empty": 0, "rand": 0, "randn": 0, "full": 0, "randint": -1}
_SIZED_METHODS = {"new_zeros": 1, "new_ones": 1, "new_empty": 1, "new_full": 1}
_FLOAT_BYTES = 4  # torch's default dtype: the fewest bytes a float factory without a dtype allocates per element


def _itemsize(op: str, dtype: Any) -> int:
    """Bytes per element: the dtype the call names (encoded `{"dtype": "uint8"}`), else torch's default float for a
    function, else 1 for a method (its tensor's dtype is not known here: the fewest bytes)."""
    try:  # tensor_bytes resolves (and refuses) dtype names: one element's bytes
        return tensor_bytes([1], dtype.get("dtype") if isinstance(dtype, Mapping) else None)
    except ValueError:
        return _FLOAT_BYTES if op == "call_function" else 1


def _dims(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _literal_elements(op: str, target: str, args: list[Any], kwargs: Mapping[str, Any]) -> int:
    """Elements a call allocates by its literal arguments alone (0: not such a call, or not known from literals).
    A lower bound where the rest depends on an input (repeat, tile: at least the product of the repeats)."""
    name = target.rsplit(".", 1)[-1]
    if op == "call_function" and name in _SIZED_FUNCTIONS:
        if "size" in kwargs:
            dims = _dims(kwargs["size"])
        elif name == "randint":  # randint(high, size) / randint(low, high, size): the size is the last positional
            dims = _dims(args[-1]) if args and isinstance(args[-1], (list, tuple)) else []
        elif name == "full":
            dims = _dims(args[0]) if args else []
        else:
            dims = _dims(args[0]) if len(args) == 1 else list(args)
    elif op == "call_function" and name == "eye":
        dims = list(args[:2]) if len(args) >= 2 else list(args) * 2
    elif op == "call_function" and name in ("linspace", "logspace"):
        dims = [kwargs.get("steps", args[2] if len(args) > 2 else 0)]
    elif op == "call_function" and name == "arange":
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if not numbers or len(numbers) != len(args):  # an end from another node: known at run time only
            return 0
        start, end, step = (0, numbers[0], 1) if len(numbers) == 1 else (*numbers[:2], numbers[2] if len(numbers) > 2 else 1)
        dims = [math.ceil((end - start) / step)] if step and math.isfinite((end - start) / step) else []
    elif op == "call_method" and name in _SIZED_METHODS:
        rest = args[_SIZED_METHODS[name]:]
        dims = _dims(kwargs["size"]) if "size" in kwargs else _dims(rest[0]) if len(rest) == 1 or name == "new_full" \
            else list(rest)
    elif (op == "call_method" and name in ("repeat", "tile")) or (op == "call_function" and name == "tile"):
        dims = [d for d in (_dims(args[1]) if len(args) == 2 else args[1:]) if isinstance(d, int)]
    else:
        return 0
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        return 0  # a size from another node (known at run time only), or malformed: the call itself says so
    return math.prod(dims)


def check_graph_sizes(graph: Any, node_ids: Iterable[str]) -> None:
    """The shapes a graph turns into allocations directly: model inputs (metadata and placeholders),
    get_attr tensors and constants, and the sizes factory calls are given as literals (torch.zeros, new_zeros,
    repeat, ...), each within this host's memory (GraphFormatError naming it)."""
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
        elif layer is not None and layer.op in ("call_function", "call_method") and isinstance(layer.target, str):
            args, kwargs = list(layer.args or ()), dict(layer.kwargs or {})
            if elements := _literal_elements(layer.op, layer.target, args, kwargs):
                check_fits(elements * _itemsize(layer.op, kwargs.get("dtype")), f"node {node_id}",
                           f"{layer.target}(...) with literal sizes ({elements:,} elements)")
