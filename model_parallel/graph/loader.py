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
Every op must also be memory-safe for any literal arguments: families whose safety rests on
unchecked indices, strides or sizes (sparse constructors, as_strided, set_/resize, *data_ptr, ...)
are refused, and an op is admitted only if the reviewed list allowed_ops.txt names it too
(graph/op_rules.py holds the rules, graph/allowed_ops.py the families and the list). Shapes that
become allocations must fit this host's memory (graph/sizes.py).

`metadata["model_class"]` is information only: it never widens these lists. A user whose model
has its own leaf module classes (or fx-wrapped functions) registers them in the process that loads
the graph: `register_layer_classes(MyBlock)` or `allow_model(model)`.
"""
from __future__ import annotations

import ast
import builtins
import keyword
import math
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from model_parallel.errors import GraphError, GraphFormatError
from model_parallel.graph import allowed_ops, op_rules
from model_parallel.graph.allowed_ops import guard_sparse, may_make_sparse  # noqa: F401 - re-exported
from model_parallel.graph.op_rules import (  # noqa: F401 - re-exported: the loader's public names
    TENSOR_ATTRIBUTES, admitted_by_code, aten_operator, aten_schema_name, canonical_path)
from model_parallel.graph.arguments import CONSTANTS, decode_argument, decode_constant
from model_parallel.graph.sizes import check_graph_sizes

MAX_EXPRESSION_CHARS = 4096  # a module constructor expression (the longest torch.nn repr is a few hundred)
MAX_NAME_CHARS = 200  # a target or node id
MAX_ARGUMENT_DEPTH = 32  # nesting of a layer's encoded arguments
MAX_ARGUMENT_ITEMS = 100_000  # values in one layer's encoded arguments

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


def _allowed_function(path: str) -> Optional[Callable[..., Any]]:
    """The function a call_function target names, if the allow-lists contain it; None otherwise."""
    if path in _registered_functions:
        return _registered_functions[path]
    if path.startswith("torch.ops."):
        return aten_operator(path)
    function = op_rules.function_by_code(path)
    return function if function is not None and allowed_ops.is_reviewed("function", canonical_path(path)) else None


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
    if not text.isprintable():  # a line break or NUL would reach logs, comments and generated code raw
        raise _refuse(where, f"{what} {text!r}", "names must be printable: no line breaks or control characters")
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
        parts = [literal_source(a) for a in self.args] + [f"{k}={literal_source(v)}" for k, v in self.kwargs.items()]
        return f"{self.path}({', '.join(parts)})"


def literal_source(value: Any) -> str:
    """`repr()` of a parsed literal, except that a non-finite float prints as `float('inf')` / `float('nan')`:
    repr gives the bare names `inf` and `nan`, which a generated module cannot evaluate (NameError on import)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({repr(value)!r})"
    if isinstance(value, complex) and not (math.isfinite(value.real) and math.isfinite(value.imag)):
        return f"complex({literal_source(value.real)}, {literal_source(value.imag)})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(map(literal_source, value)) + ("," if isinstance(value, tuple) and len(value) == 1 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal_source(k)}: {literal_source(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)) and value:
        return "{" + ", ".join(map(literal_source, value)) + "}"
    return repr(value)


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
    cls = _registered_classes.get(path) or (op_rules.torch_nn_classes().get(path)
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
    if not isinstance(name, str) or name not in op_rules.tensor_methods():
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
    "aten_operator", "aten_schema_name", "admitted_by_code", "guard_sparse", "may_make_sparse",
]
