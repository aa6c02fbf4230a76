"""The allow-list rules of the safe layer loader: which functions, ATen ops, methods and module classes
a graph file may name, decided by code (namespaces, denied words, refused families) and narrowed by the
reviewed list (graph/allowed_ops.py, allowed_ops.txt). graph/loader.py applies them to a graph."""
from __future__ import annotations

import builtins
import importlib
import math
import operator
import re
import types
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, Optional

import torch
from torch import nn

from model_parallel.graph import allowed_ops

# The only attributes `getattr(<node>, name)` may read: what fx records for `x.shape`, `x.device`, ...
TENSOR_ATTRIBUTES = frozenset((
    "shape", "dtype", "device", "ndim", "T", "mT", "H", "mH", "is_cuda", "is_sparse", "is_quantized",
    "is_meta", "is_cpu", "layout", "requires_grad", "real", "imag", "itemsize", "nbytes", "is_leaf",
))
_OPERATOR_FUNCTIONS = frozenset((
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "pos", "abs", "invert",
    "not_", "and_", "or_", "xor", "lshift", "rshift", "eq", "ne", "lt", "le", "gt", "ge", "getitem",
    "setitem", "contains", "truth", "is_", "is_not", "index", "iadd", "isub", "imul", "itruediv",
    "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor", "ilshift", "irshift",
))
_BUILTIN_FUNCTIONS = frozenset((
    "len", "int", "float", "bool", "abs", "min", "max", "sum", "round", "divmod", "pow", "tuple", "list",
    "range", "slice", "all", "any",
))
# Public torch functions that touch files, global state, threads or code instead of tensors.
_TORCH_DENIED = re.compile(
    r"(^set_|^use_|^get_|load|save|file|import|fork|dlpack|thread|autocast|anomaly|seed|rng|flush|cache|"
    r"hook|register|storage|compile|export|torch_function|^vmap$|^cond$|^while_loop$|^classproperty$|"
    r"^prepare_multiprocessing_environment$|^profiler_)"
)
_TORCH_EXTRA = frozenset(("torch._assert",))
# Private ATen ops export's training IR may still record: functional kernels with no side effects.
_ATEN_PRIVATE = frozenset(("_to_copy", "_softmax", "_log_softmax", "_unsafe_view", "_native_batch_norm_legit_functional",
                           "_native_batch_norm_legit_no_training", "_safe_softmax", "_unsafe_index"))
_ATEN_PATH = re.compile(r"^torch\.ops\.aten\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")  # fx keeps `torch._assert` (ViT's shape checks) as a call
# torchvision functions fx records as calls (they are `torch.fx.wrap`ped), by exact name.
_TORCHVISION_FUNCTIONS = frozenset((
    "torchvision.ops.stochastic_depth.stochastic_depth",
    "torchvision.models.swin_transformer._get_relative_position_bias",
    "torchvision.models.swin_transformer._patch_merging_pad",
    "torchvision.models.swin_transformer.shifted_window_attention",
))
# Tensor methods that take callables, expose storage/memory/files or leave torch (numpy's dump/tofile).
_METHODS_DENIED = frozenset((
    "register_hook", "register_post_accumulate_grad_hook", "apply_", "map_", "map2_", "storage",
    "untyped_storage", "share_memory_", "is_shared", "numpy", "backward", "set_", "record_stream",
    "as_subclass", "module_load", "data_ptr", "pin_memory", "to_dlpack", "new", "storage_type",
))
_DUNDER_METHODS = frozenset(("__getitem__", "__setitem__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
                             "__rmul__", "__truediv__", "__rtruediv__", "__matmul__", "__neg__", "__pow__", "__and__",
                             "__or__"))

@lru_cache(maxsize=1)
def torch_nn_classes() -> Mapping[str, type]:
    """`torch.nn.X` and `torch.nn.modules.<file>.X` -> class, for every torch.nn module class."""
    table: dict[str, type] = {}
    for name, value in vars(nn).items():
        if isinstance(value, type) and issubclass(value, nn.Module) and not name.startswith("_"):
            if not value.__module__.startswith("torch.nn.parallel"):  # wrappers of other modules, never leaves
                table[f"torch.nn.{name}"] = value
    stack = [nn.Module]
    while stack:  # classes printed by file path, e.g. torch.nn.modules.linear.NonDynamicallyQuantizableLinear
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if sub.__module__.startswith("torch.nn.modules.") and not sub.__name__.startswith("_"):
                table[f"{sub.__module__}.{sub.__qualname__}"] = sub
    return table


@lru_cache(maxsize=1)
def torch_namespaces() -> Mapping[str, types.ModuleType]:
    """Namespaces whose public ops a graph may call (fx names F.linear `torch._C._nn.linear`)."""
    import torch.fft
    import torch.functional
    import torch.linalg
    import torch.nn.functional
    import torch.special

    return {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.functional": torch.functional,
            "torch.fft": torch.fft, "torch.linalg": torch.linalg, "torch.special": torch.special,
            # torch's _C stubs omit _fft, _linalg and _special (they exist at run time).
            "torch._C._nn": torch._C._nn, "torch._C._fft": torch._C._fft,  # type: ignore[attr-defined]
            "torch._C._linalg": torch._C._linalg,  # type: ignore[attr-defined]
            "torch._C._special": torch._C._special}  # type: ignore[attr-defined]


def _namespace_function(namespace: str, name: str) -> Optional[Callable[..., Any]]:
    value = vars(torch_namespaces()[namespace]).get(name)
    if isinstance(value, types.BuiltinFunctionType):
        return value
    if isinstance(value, types.FunctionType) and value.__module__ in ("torch.functional", "torch.nn.functional"):
        return value  # torch's own Python ops (einsum, split, F.relu, ...), not torch.load and friends
    return None


def canonical_path(path: str) -> str:
    """`len` -> `builtins.len`, `_operator.add` -> `operator.add`: how allowed_ops.txt names a function."""
    namespace, _, name = path.rpartition(".")
    namespace = {"": "builtins", "_operator": "operator"}.get(namespace, namespace)
    return f"{namespace}.{name}"


def function_by_code(path: str) -> Optional[Callable[..., Any]]:
    """What the code's rules alone admit for `path` (not ATen, not registered functions), before the reviewed list."""
    namespace, _, name = path.rpartition(".")
    namespace = {"": "builtins", "_operator": "operator"}.get(namespace, namespace)
    if namespace == "builtins":
        return getattr(builtins, name) if name in _BUILTIN_FUNCTIONS or name == "getattr" else None
    if namespace == "operator":
        return vars(operator)[name] if name in _OPERATOR_FUNCTIONS else None
    if namespace == "math":
        value = vars(math).get(name)
        return value if isinstance(value, types.BuiltinFunctionType) and not name.startswith("_") else None
    if path in _TORCH_EXTRA:
        return vars(torch)[name]
    if namespace in torch_namespaces() and not name.startswith("_") and not _TORCH_DENIED.search(name) \
            and allowed_ops.refused_family(name) is None:
        return _namespace_function(namespace, name)
    if path in _TORCHVISION_FUNCTIONS:
        from model_parallel.compat import import_torchvision

        import_torchvision()  # repairs the CPU/CUDA mismatch before torchvision submodules import
        return vars(importlib.import_module(namespace))[name]
    return None


def aten_operator(path: str) -> Optional[Callable[..., Any]]:
    """`torch.ops.aten.<op>.<overload>` -> that OpOverload, for public ATen ops the torch denylist does not
    name (files, RNG seeding, storage, ...) and a few private functional ones; None for anything else
    (other namespaces, higher-order ops, custom ops)."""
    match = _ATEN_PATH.match(path)
    if match is None:
        return None
    op, overload = match.groups()
    if not (aten_admitted_by_code(op) and allowed_ops.is_reviewed("aten", op)):
        return None
    try:
        packet = getattr(torch.ops.aten, op)
        value = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None
    return value if isinstance(value, torch._ops.OpOverload) and value.namespace == "aten" else None


def aten_admitted_by_code(op: str) -> bool:
    """Whether the code's rules admit ATen op name `op` (public, no denied word, no refused family, or a listed private one)."""
    if op.startswith("_"):
        return op in _ATEN_PRIVATE
    return not _TORCH_DENIED.search(op) and allowed_ops.refused_family(op) is None


def aten_schema_name(target: str) -> Optional[str]:
    """`"torch.ops.aten.silu_.default"` -> `"silu_"`; None for other targets."""
    match = _ATEN_PATH.match(target)
    return match.group(1) if match else None


def methods_by_code() -> frozenset:
    names = {n for n in dir(torch.Tensor) if not n.startswith("_") and callable(getattr(torch.Tensor, n, None))
             and allowed_ops.refused_family(n) is None}
    return frozenset(names - _METHODS_DENIED) | _DUNDER_METHODS


@lru_cache(maxsize=1)
def tensor_methods() -> frozenset:
    return frozenset(n for n in methods_by_code() if allowed_ops.is_reviewed("method", n))


def admitted_by_code() -> set[tuple[str, str]]:
    """(kind, name) of everything the code's rules admit, before the reviewed list (allowed_ops.txt)
    narrows it: what tests/test_allowed_ops.py compares with that list, and tools/write_allowed_ops.py writes."""
    entries = {("module", path) for path in torch_nn_classes()}
    candidates = [f"{ns}.{name}" for ns, module in torch_namespaces().items() for name in vars(module)]
    candidates += [f"operator.{n}" for n in _OPERATOR_FUNCTIONS] + [f"builtins.{n}" for n in _BUILTIN_FUNCTIONS]
    candidates += ["builtins.getattr", *_TORCH_EXTRA, *_TORCHVISION_FUNCTIONS]
    candidates += [f"math.{n}" for n in vars(math)]
    entries |= {("function", p) for p in candidates if function_by_code(p) is not None}
    ops = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    entries |= {("aten", op) for op in ops if aten_admitted_by_code(op)}
    entries |= {("method", m) for m in methods_by_code()} | {("attribute", a) for a in TENSOR_ATTRIBUTES}
    return entries
