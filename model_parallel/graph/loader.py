"""The safe layer loader: what a graph file may ask for, decided by code and never widened by the file.

A graph.json names, for every node, the call its layer makes. Before any layer is built, every
node is checked against closed allow-lists (`check_graph`), so a hostile file is refused with a
`GraphFormatError` naming the node before anything runs:

    call_module    a constructor `torch.nn.Conv2d(3, 64, kernel_size=(7, 7))`: a torch.nn module
                   class, or a class the running process registered (`register_layer_classes`,
                   `allow_model`), called with literal arguments only
    call_function  torch ops (torch, torch.nn.functional, torch.functional and the builtin ops of
                   torch.fft / linalg / special), a fixed list of operator functions, builtins and
                   math functions, a few torchvision functions fx records, and functions the
                   process registered (`register_functions`); `getattr` only as
                   getattr(<node>, "<tensor attribute>") with the attribute in TENSOR_ATTRIBUTES
    call_method    public torch.Tensor methods, except those taking callables (hooks, apply_,
                   map_) or exposing storage, files or numpy
    get_attr       an attribute path without dunder parts
Arguments are literals and node references only (graph.arguments); keyword names are identifiers.

`metadata["model_class"]` is information only: it never widens these lists. A user whose model
has its own leaf module classes (or fx-wrapped functions) registers them in the process that loads
the graph: `register_layer_classes(MyBlock)` or `allow_model(model)`.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import keyword
import math
import operator
import re
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch
from torch import nn

from model_parallel.errors import GraphError, GraphFormatError
from model_parallel.graph import allowed_ops
from model_parallel.graph.arguments import CONSTANTS, decode_argument, decode_constant
from model_parallel.graph.sizes import check_graph_sizes

MAX_EXPRESSION_CHARS = 4096  # a module constructor expression (the longest torch.nn repr is a few hundred)
MAX_NAME_CHARS = 200  # a target or node id
MAX_ARGUMENT_DEPTH = 32  # nesting of a layer's encoded arguments
MAX_ARGUMENT_ITEMS = 100_000  # values in one layer's encoded arguments

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
_REGISTER_HINT = ("if it is your model's own code, register it in the process that loads the graph: "
                  "model_parallel.graph.loader.register_layer_classes(MyLayer) / register_functions(my_fn), "
                  "or allow_model(model, traced=fx_graph_module) for a model it holds")

_registered_classes: dict[str, type] = {}
_registered_functions: dict[str, Callable[..., Any]] = {}


# ---- what the process allows --------------------------------------------------------------------
def qualified_name(obj: Any) -> str:
    """`module.qualname` of a class or function, as a graph names it (`_operator` spelled `operator`)."""
    module = getattr(obj, "__module__", None) or "builtins"
    return f"{'operator' if module == '_operator' else module}.{obj.__qualname__}"


def register_layer_classes(*classes: type) -> None:
    """Allow graphs loaded by this process to construct these nn.Module classes (by `module.qualname`)."""
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"register_layer_classes takes nn.Module classes, got {cls!r}")
        _registered_classes[qualified_name(cls)] = cls


def register_functions(*functions: Callable[..., Any]) -> None:
    """Allow graphs loaded by this process to call these functions (e.g. your `torch.fx.wrap`ped helpers)."""
    for function in functions:
        if not isinstance(function, (types.FunctionType, types.BuiltinFunctionType)):
            raise TypeError(f"register_functions takes plain functions, got {function!r}")
        _registered_functions[qualified_name(function)] = function


def allow_model(model: nn.Module, traced: Any = None) -> None:
    """Allow the classes of every submodule of `model`, a model this process holds (and so vouches for),
    and, given its fx trace `traced`, the model's own Python functions the trace calls (fx-wrapped helpers)."""
    register_layer_classes(*{type(m) for m in model.modules()})
    if traced is not None:
        register_functions(*{n.target for n in traced.graph.nodes if n.op == "call_function"
                             and isinstance(n.target, types.FunctionType) and n.target.__module__ != "builtins"})


@lru_cache(maxsize=1)
def _torch_nn_classes() -> Mapping[str, type]:
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
def _torch_namespaces() -> Mapping[str, types.ModuleType]:
    """Namespaces whose public ops a graph may call (fx names F.linear `torch._C._nn.linear`)."""
    import torch.fft
    import torch.functional
    import torch.linalg
    import torch.nn.functional
    import torch.special

    return {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.functional": torch.functional,
            "torch.fft": torch.fft, "torch.linalg": torch.linalg, "torch.special": torch.special,
            "torch._C._nn": torch._C._nn, "torch._C._fft": torch._C._fft, "torch._C._linalg": torch._C._linalg,
            "torch._C._special": torch._C._special}


def _namespace_function(namespace: str, name: str) -> Optional[Callable[..., Any]]:
    value = vars(_torch_namespaces()[namespace]).get(name)
    if isinstance(value, types.BuiltinFunctionType):
        return value
    if isinstance(value, types.FunctionType) and value.__module__ in ("torch.functional", "torch.nn.functional"):
        return value  # torch's own Python ops (einsum, split, F.relu, ...), not torch.load and friends
    return None


def _allowed_function(path: str) -> Optional[Callable[..., Any]]:
    """The function a call_function target names, if the allow-lists contain it; None otherwise."""
    if path in _registered_functions:
        return _registered_functions[path]
    if path.startswith("torch.ops."):
        return aten_operator(path)
    function = _function_by_code(path)
    return function if function is not None and allowed_ops.is_reviewed("function", canonical_path(path)) else None


def canonical_path(path: str) -> str:
    """`len` -> `builtins.len`, `_operator.add` -> `operator.add`: how allowed_ops.txt names a function."""
    namespace, _, name = path.rpartition(".")
    namespace = {"": "builtins", "_operator": "operator"}.get(namespace, namespace)
    return f"{namespace}.{name}"


def _function_by_code(path: str) -> Optional[Callable[..., Any]]:
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
    if namespace in _torch_namespaces() and not name.startswith("_") and not _TORCH_DENIED.search(name) \
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


def _methods_by_code() -> frozenset:
    names = {n for n in dir(torch.Tensor) if not n.startswith("_") and callable(getattr(torch.Tensor, n, None))
             and allowed_ops.refused_family(n) is None}
    return frozenset(names - _METHODS_DENIED) | _DUNDER_METHODS


@lru_cache(maxsize=1)
def _tensor_methods() -> frozenset:
    return frozenset(n for n in _methods_by_code() if allowed_ops.is_reviewed("method", n))


def admitted_by_code() -> set[tuple[str, str]]:
    """(kind, name) of everything the code's rules admit, before the reviewed list (allowed_ops.txt)
    narrows it: what tests/test_allowed_ops.py compares with that list, and tools/write_allowed_ops.py writes."""
    entries = {("module", path) for path in _torch_nn_classes()}
    candidates = [f"{ns}.{name}" for ns, module in _torch_namespaces().items() for name in vars(module)]
    candidates += [f"operator.{n}" for n in _OPERATOR_FUNCTIONS] + [f"builtins.{n}" for n in _BUILTIN_FUNCTIONS]
    candidates += ["builtins.getattr", *_TORCH_EXTRA, *_TORCHVISION_FUNCTIONS]
    candidates += [f"math.{n}" for n in vars(math)]
    entries |= {("function", p) for p in candidates if _function_by_code(p) is not None}
    ops = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    entries |= {("aten", op) for op in ops if aten_admitted_by_code(op)}
    entries |= {("method", m) for m in _methods_by_code()} | {("attribute", a) for a in TENSOR_ATTRIBUTES}
    return entries


# ---- checks -------------------------------------------------------------------------------------
def _refuse(where: str, what: str, why: str, fix: str = "") -> GraphFormatError:
    return GraphFormatError(f"{where}: {what} is not allowed in a graph file ({why})" + (f"; {fix}" if fix else ""))


def _check_name(text: Any, where: str, what: str) -> str:
    """A dotted name: ASCII identifiers (no look-alike letters), no dunder parts, bounded length."""
    if not isinstance(text, str) or not text:
        raise _refuse(where, f"{what} {text!r}", "expected a non-empty string")
    if len(text) > MAX_NAME_CHARS:
        raise _refuse(where, f"{what} {text[:40]!r}... ({len(text)} characters)", f"names are at most {MAX_NAME_CHARS}")
    if not text.isascii():
        raise _refuse(where, f"{what} {text!r}", "names must be ASCII: look-alike letters are refused")
    if any(part.startswith("__") for part in text.split(".")):
        raise _refuse(where, f"{what} {text!r}", "dunder names reach into Python internals")
    return text


@dataclass(frozen=True)
class Constructor:
    """A parsed module expression: `path(*args, **kwargs)` with literal arguments; `source` is canonical."""

    path: str
    args: tuple
    kwargs: dict

    @property
    def source(self) -> str:
        """The expression re-printed from its parsed values (what generated packages contain)."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.path}({', '.join(parts)})"


def parse_constructor(expression: Any, where: str = "module expression") -> Constructor:
    """Parse `dotted.Name(<literals>)`; anything else (calls, names, lambdas, **kwargs in the arguments) is refused."""
    if not isinstance(expression, str):
        raise _refuse(where, f"module expression {expression!r}", "expected a string like torch.nn.Linear(4, 4)")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise _refuse(where, f"a module expression of {len(expression)} characters",
                      f"expressions are at most {MAX_EXPRESSION_CHARS}")
    if not expression.isascii():  # Python folds look-alikes (fullwidth `ｏｓ` parses as `os`): refuse them
        raise _refuse(where, f"module expression {expression[:80]!r}", "expressions must be ASCII")
    try:
        call = ast.parse(expression.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise _refuse(where, f"module expression {expression[:80]!r}", f"not a Python expression: {error}") from None
    if not isinstance(call, ast.Call):
        raise _refuse(where, f"module expression {expression[:80]!r}", "expected one call like torch.nn.Linear(4, 4)")
    path = ast.unparse(call.func)
    if not all(part.isidentifier() for part in path.split(".")):
        raise _refuse(where, f"module expression {expression[:80]!r}", f"{path[:80]!r} is not a dotted class name")
    _check_name(path, where, "module class")
    if any(k.arg is None for k in call.keywords):
        raise _refuse(where, f"module expression {expression[:80]!r}", "**kwargs are not allowed")
    if any(isinstance(a, ast.Starred) for a in call.args):
        raise _refuse(where, f"module expression {expression[:80]!r}", "*args are not allowed")
    try:
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise _refuse(where, f"module expression {expression[:80]!r}",
                      "arguments must be literals (numbers, strings, tuples, ...), not names or calls") from None
    for name in kwargs:
        _check_name(name, where, "keyword argument")
    return Constructor(path, args, kwargs)


def module_class(path: str, where: str) -> type:
    """The nn.Module class a constructor names: torch.nn's, or one this process registered."""
    cls = _registered_classes.get(path) or (_torch_nn_classes().get(path)
                                            if allowed_ops.is_reviewed("module", path) else None)
    if cls is None:
        raise _refuse(where, f"module class {path!r}", "only torch.nn module classes and classes registered by "
                      "the process loading the graph can be constructed", _REGISTER_HINT)
    return cls


def build_module(expression: str, where: str = "module expression") -> nn.Module:
    """Build the module a constructor expression describes, after checking it (see the module docstring)."""
    constructor = parse_constructor(expression, where)
    cls = module_class(constructor.path, where)
    return cls(*constructor.args, **constructor.kwargs)


def function_target(path: str, args: tuple = (), where: str = "call_function") -> Callable[..., Any]:
    """The function a call_function node calls, checked against the allow-lists (see the module docstring)."""
    _check_name(path, where, "function")
    function = _allowed_function(path)
    if function is None:
        name = aten_schema_name(path) or path.rpartition(".")[2]
        family = allowed_ops.refused_family(name)
        if family is not None:
            raise _refuse(where, f"function {path!r}", f"not memory-safe for literal arguments: {family}")
        raise _refuse(where, f"function {path!r}", "functions must be torch ops, ATen operators, arithmetic/comparison "
                      "operators, a few builtins and math functions listed in model_parallel/graph/allowed_ops.txt, "
                      "or functions registered by the process", _REGISTER_HINT)
    if function is builtins.getattr:
        node, attribute = args if len(args) == 2 else (None, None)
        if not (isinstance(node, Mapping) and "node" in node) or not isinstance(attribute, str) \
                or attribute not in TENSOR_ATTRIBUTES or not allowed_ops.is_reviewed("attribute", attribute):
            raise _refuse(where, f"getattr with arguments {list(args)[:3]!r}"[:200],
                          f"only getattr(<node>, name) with name one of {', '.join(sorted(TENSOR_ATTRIBUTES))}")
    return function


def check_method(name: str, where: str) -> str:
    """A call_method name: a public torch.Tensor method that takes no callables and exposes no storage."""
    if not isinstance(name, str) or name not in _tensor_methods():
        family = allowed_ops.refused_family(name) if isinstance(name, str) else None
        raise _refuse(where, f"tensor method {name!r}"[:200], f"not memory-safe for literal arguments: {family}"
                      if family else "methods must be public torch.Tensor methods other than hooks, storage, numpy "
                      "and callable-taking ones, listed in model_parallel/graph/allowed_ops.txt")
    return name


def _check_arguments(args: Iterable[Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Keyword names are identifiers (fx prints them into source), nesting and size are bounded."""
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key) or not key.isascii():
            raise _refuse(where, f"keyword argument name {str(key)[:80]!r}", "keyword names must be plain identifiers")
        _check_name(key, where, "keyword argument")
    stack = [(value, 1) for value in (*args, *kwargs.values())]
    count = 0
    while stack:  # iterative: a hostile nesting depth must not overflow the interpreter's stack
        value, depth = stack.pop()
        count += 1
        if depth > MAX_ARGUMENT_DEPTH or count > MAX_ARGUMENT_ITEMS:
            raise _refuse(where, "arguments nested this deep or this many", f"at most {MAX_ARGUMENT_DEPTH} levels and "
                          f"{MAX_ARGUMENT_ITEMS} values")
        if isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, str) and len(value) > MAX_EXPRESSION_CHARS:
            raise _refuse(where, f"a string argument of {len(value)} characters", f"at most {MAX_EXPRESSION_CHARS}")
    try:  # typed values decode to exactly their type: `{"dtype": "load"}` is refused, not torch.load
        for value in (*args, *kwargs.values()):
            decode_argument(value, lambda ref: None, lambda: None)
    except GraphError as error:
        raise _refuse(where, "an argument", str(error)) from None


def describe_node(graph: Any, node_id: str) -> str:
    return f"node {node_id} ({graph[node_id].description[:60]})"


def check_layer(graph: Any, node_id: str, *, build_constructor: bool = True) -> None:
    """Refuse a node whose layer asks for anything outside the allow-lists (GraphFormatError naming the node).

    `build_constructor=False` checks a module expression's form but not its class (the caller hands
    the module over, or, like the coordinator, never builds layers).
    """
    node = graph[node_id]
    where = describe_node(graph, node_id)
    _check_name(node_id, where, "node id")
    layer = node.layer
    if layer is None:
        return
    _check_arguments(layer.args, layer.kwargs, where)
    for meta in layer.outputs:
        if not isinstance(getattr(torch, str(meta.dtype), None), torch.dtype):
            raise _refuse(where, f"output dtype {str(meta.dtype)[:40]!r}", "expected a torch dtype name like float32")
    if layer.op == "call_function":
        function_target(layer.target, tuple(layer.args), where)
    elif layer.op == "call_method":
        check_method(layer.target, where)
    elif layer.op in ("call_module", "get_attr", "placeholder"):
        _check_name(layer.target, where, f"{layer.op} target")
    if layer.op == "call_module" and layer.module is not None:
        constructor = parse_constructor(layer.module, where)
        if build_constructor:
            module_class(constructor.path, where)


def may_make_sparse(graph: Any, node_ids: Iterable[str]) -> bool:
    """Whether any of these layers can produce sparse values (an op, argument or constructor mentions
    sparse): where it can, layers run with torch's sparse invariant checks on (`guard_sparse`)."""
    for node_id in node_ids:
        layer = graph[node_id].layer
        if layer is not None and "sparse" in repr((layer.target, layer.args, dict(layer.kwargs), layer.module)):
            return True
    return False


def guard_sparse(graph: Any, node_ids: Iterable[str]) -> None:
    """Turn on torch's sparse tensor invariant checks in this process when these layers can make sparse
    values: torch skips them by default, and an invalid sparse tensor corrupts memory in the next op.
    (The constructors that take literal indices are refused outright; this covers every other way in.)"""
    if may_make_sparse(graph, node_ids):
        torch.sparse.check_sparse_tensor_invariants.enable()


def check_graph(graph: Any, node_ids: Optional[Iterable[str]] = None, *, handed_over: Iterable[str] = (),
                build_constructors: bool = True) -> None:
    """`check_layer` on `node_ids` (default: every node) before anything is built; `handed_over` are
    node ids whose module the caller supplies, so their constructor is never called."""
    skip = set(handed_over)
    _check_arguments((graph.metadata.get("outputs"),), {}, "graph metadata 'outputs'")
    constants = graph.metadata.get(CONSTANTS) or {}
    if not isinstance(constants, Mapping):
        raise _refuse(f"graph metadata {CONSTANTS!r}", "a non-mapping", "expected {get_attr target: record}")
    for target, record in constants.items():
        where = f"graph metadata {CONSTANTS!r} entry {str(target)[:80]!r}"
        _check_name(target, where, "constant name")
        try:
            decode_constant(record, where)
        except GraphError as error:
            raise _refuse(where, "a constant", str(error)) from None
    ids = list(node_ids if node_ids is not None else graph.by_id)
    for node_id in ids:
        check_layer(graph, node_id, build_constructor=build_constructors and node_id not in skip)
    check_graph_sizes(graph, ids)  # shapes that become allocations fit this host, before any is made


__all__ = [
    "register_layer_classes", "register_functions", "allow_model", "check_graph", "check_layer", "build_module",
    "parse_constructor", "module_class", "function_target", "check_method", "Constructor", "TENSOR_ATTRIBUTES",
    "aten_operator", "aten_schema_name",
]
