"""Sizes a graph file asks for are refused in one line before anything is allocated (issue 33, item 6).

A module constructor, a get_attr tensor, a constant or a model input whose bytes exceed this host's
memory must not reach the allocator: Linux overcommits, so the process would be killed while it
fills the pages instead of being told what is wrong.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from model_parallel.codegen.build import build_stages, full_model_from_graph
from model_parallel.errors import CodegenError, GraphFormatError, InitError
from model_parallel.graph import loader, sizes
from model_parallel.graph.json_format import graph_from_dict
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.runtime.build.materialize import Initializer, materialize_layers

torch.set_num_threads(1)
HUGE = 1 << 40  # elements: 4 TiB of float32, more than any test host has


def _graph(layer: dict, metadata: dict | None = None) -> dict:
    meta = [{"shape": [2, 4], "dtype": "float32"}]
    nodes = [("x", {"op": "placeholder", "target": "x", "outputs": meta}), ("big", layer),
             ("out", {"op": "call_function", "target": "operator.add", "args": [{"node": "x"}, {"node": "big"}]})]
    return {"schema": "model_parallel.graph", "version": 1,
            "metadata": {"outputs": {"node": "out"}, **(metadata or {})},
            "nodes": [{"id": i, "description": layer["op"], "forward_ms": 1.0, "backward_ms": 1.0,
                       "activation_size": 32.0, "parameter_size": 0.0, "stage_id": 0, "layer": layer} for i, layer in nodes],
            "edges": [["x", "big"], ["x", "out"], ["big", "out"]]}


def _plan(graph) -> Plan:
    return Plan((StagePlan(0, tuple(graph.topological_order), ranks=(0,)),))


def test_a_module_larger_than_the_host_is_refused_before_it_is_built() -> None:
    graph = graph_from_dict(_graph({"op": "call_module", "target": "big", "args": [{"node": "x"}],
                                    "module": f"torch.nn.Linear({1 << 20}, {1 << 20})"}), "g.json")
    with pytest.raises(CodegenError, match=r"node big .*module torch.nn.Linear.*needs 4,096.0 GiB, more than this host's memory"):
        build_stages(graph, _plan(graph))
    with torch.device("meta"):  # nothing is allocated on meta: the worker builds there, then materializes
        model = full_model_from_graph(graph)
    with pytest.raises(InitError, match=r"layers big: allocating 1 layer\(s\) \(the largest, big, 4,096.0 GiB\).*host's memory"):
        materialize_layers(dict(model.named_children()), ["big"], Initializer(seed=0))


@pytest.mark.parametrize("case", ["get_attr", "input", "constant", "placeholder"])
def test_shapes_that_become_allocations_are_refused_by_the_loader(case: str) -> None:
    big = [{"shape": [HUGE], "dtype": "float32"}]
    layer = {"op": "get_attr", "target": "big", "outputs": big if case == "get_attr" else [{"shape": [2, 4], "dtype": "float32"}]}
    metadata = {"inputs": [{"name": "x", "shape": [HUGE, 4], "dtype": "float32"}]} if case == "input" else {}
    if case == "constant":
        metadata = {"constants": {"big": {"shape": [HUGE], "dtype": "float32"}}}
    data = _graph(layer, metadata)
    if case == "placeholder":
        data["nodes"][0]["layer"]["outputs"] = big
    graph = graph_from_dict(data, "g.json")
    with pytest.raises(GraphFormatError, match=r"needs [0-9,.]+ GiB, more than this host's memory"):
        loader.check_graph(graph)


def test_shapes_that_are_not_integers_are_refused() -> None:
    data = _graph({"op": "get_attr", "target": "big", "outputs": [{"shape": [2, 4], "dtype": "float32"}]},
                  {"inputs": [{"name": "x", "shape": [2, -4], "dtype": "float32"}]})
    with pytest.raises(GraphFormatError, match=r"'inputs'\[0\].*not a list of non-negative integers"):
        loader.check_graph(graph_from_dict(data, "g.json"))


def test_ordinary_sizes_pass() -> None:
    assert sizes.tensor_bytes([2, 4], "float32") == 32
    assert sizes.module_bytes(nn.Linear(4, 4)) == (16 + 4) * 4
    graph = graph_from_dict(_graph({"op": "call_module", "target": "big", "args": [{"node": "x"}],
                                    "module": "torch.nn.Linear(4, 4)"}), "g.json")
    (stage,) = build_stages(graph, _plan(graph))
    assert stage(torch.ones(2, 4))[0].shape == (2, 4)


H = 1 << 20  # HUGE = H * H elements


@pytest.mark.parametrize("layer", [
    {"op": "call_function", "target": "torch.zeros", "args": [[H, H]]},
    {"op": "call_function", "target": "torch.randn", "args": [H, H]},
    {"op": "call_function", "target": "torch.ones", "kwargs": {"size": [H, H]}},
    {"op": "call_function", "target": "torch.full", "args": [[H, H], 1.0]},
    {"op": "call_function", "target": "torch.randint", "args": [0, 9, [H, H]]},
    {"op": "call_function", "target": "torch.empty", "args": [[H, H]], "kwargs": {"dtype": {"dtype": "uint8"}}},
    {"op": "call_function", "target": "torch.eye", "args": [H]},
    {"op": "call_function", "target": "torch.arange", "args": [HUGE]},
    {"op": "call_function", "target": "torch.linspace", "args": [0, 1, HUGE]},
    {"op": "call_method", "target": "new_zeros", "args": [{"node": "x"}, [H, H]]},
    {"op": "call_method", "target": "repeat", "args": [{"node": "x"}, H, H]},
])
def test_literal_sizes_of_factory_calls_are_refused_by_the_loader(layer: dict) -> None:
    # A security QA: a graph.json asking torch.zeros([100000, 100000]) (40 GB) passed the loader and reached the allocator.
    graph = graph_from_dict(_graph({"args": [], "kwargs": {}, **layer}), "g.json")
    with pytest.raises(GraphFormatError, match=r"node big: .*with literal sizes \([0-9,]+ elements\) needs [0-9,.]+ GiB, "
                                               r"more than this host's memory"):
        loader.check_graph(graph)


def test_factory_calls_of_ordinary_or_run_time_sizes_pass() -> None:
    for layer in ({"op": "call_function", "target": "torch.zeros", "args": [[2, 4]]},
                  {"op": "call_method", "target": "new_zeros", "args": [{"node": "x"}, [2, 4]]},
                  {"op": "call_method", "target": "repeat", "args": [{"node": "x"}, 1, 1]},
                  {"op": "call_method", "target": "view", "args": [{"node": "x"}, H, H]}):  # a view allocates nothing
        loader.check_graph(graph_from_dict(_graph({"kwargs": {}, **layer}), "g.json"))
