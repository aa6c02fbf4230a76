"""A graph node's layer object: the module a call_module node runs, the tensor a get_attr node reads."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

from model_parallel.errors import CodegenError, GraphError
from model_parallel.graph import loader, sizes
from model_parallel.graph.arguments import CONSTANTS, decode_constant
from model_parallel.graph.core import Graph, LayerSpec, Node

ModulesArg = Optional[Mapping[str, Union[nn.Module, torch.Tensor]]]


def node_where(graph: Graph, node_id: str) -> str:
    return loader.describe_node(graph, node_id)


def make_module(
    graph: Graph, node: Node, *, modules: ModulesArg = None, source_model: Optional[nn.Module] = None
) -> nn.Module:
    """The module a call_module node runs: handed over in `modules`, else built from its constructor
    expression, else taken from `source_model`."""
    layer = layer_of(graph, node)
    name = graph.attribute_names[layer.target]
    if modules is not None:
        given = modules.get(name, modules.get(layer.target))
        if given is not None:
            if not isinstance(given, nn.Module):
                raise CodegenError(f"{node_where(graph, node.node_id)}: modules[{name!r}] is a {type(given).__name__}, expected nn.Module")
            return given
    if layer.module is not None:
        where = node_where(graph, node.node_id)
        constructor = loader.parse_constructor(layer.module, where)
        cls = loader.module_class(constructor.path, where)  # checked: a torch.nn or registered class
        if torch.get_default_device().type != "meta" and cls.__module__.startswith("torch.nn."):  # registered: vouched for
            sizes.check_module_fits(cls, constructor.args, constructor.kwargs, where, f"module {constructor.source[:80]}",
                                    CodegenError)
        try:
            return cls(*constructor.args, **constructor.kwargs)
        except Exception as error:  # a constructor may raise anything; report it with the node
            raise CodegenError(f"{where}: cannot build {layer.module!r}: {error}") from None
    if source_model is not None:
        try:
            return source_model.get_submodule(layer.target)
        except AttributeError:
            raise CodegenError(
                f"{node_where(graph, node.node_id)}: source_model has no submodule {layer.target!r}; "
                "is it the model the graph was traced from?"
            ) from None
    raise CodegenError(
        f"{node_where(graph, node.node_id)}: module {layer.target!r} has no constructor expression in the graph; "
        "pass source_model=<the original model> (or modules={...}) so it can be taken from there"
    )


def make_attribute(
    graph: Graph, node: Node, *, modules: ModulesArg = None, source_model: Optional[nn.Module] = None
) -> torch.Tensor:
    """The tensor a get_attr node reads; without a source, a constant's recorded value
    (`metadata["constants"]`), else an uninitialised one of the recorded shape (its value comes with
    the state dict), a Parameter if the profile counted it as one."""
    layer = layer_of(graph, node)
    name = graph.attribute_names[layer.target]
    if modules is not None:
        given = modules.get(name, modules.get(layer.target))
        if isinstance(given, torch.Tensor):
            return given
    if source_model is not None:
        value: Any = source_model
        try:
            for part in layer.target.split("."):
                value = getattr(value, part)
        except AttributeError:
            value = None
        if isinstance(value, torch.Tensor):
            return value
    constants = graph.metadata.get(CONSTANTS) or {}
    if layer.target in constants:  # no state dict carries it: never an uninitialised tensor
        where = f"{node_where(graph, node.node_id)}: constant {layer.target!r}"
        try:
            with torch.device("cpu"):  # a constant needs its values, also in a model built on meta
                value = decode_constant(constants[layer.target], where)
        except GraphError as error:
            raise CodegenError(str(error)) from None
        if value is None:
            raise CodegenError(
                f"{where} (a non-persistent buffer or lifted constant) is too large to be stored in the graph "
                "and no state dict carries it; pass source_model=<the original model> (or modules={...}) to take it from there"
            )
        return value
    if not layer.outputs:
        raise CodegenError(
            f"{node_where(graph, node.node_id)}: attribute {layer.target!r} has no recorded shape; "
            "pass source_model=<the original model> so it can be taken from there"
        )
    meta = layer.outputs[0]
    sizes.check_tensor_fits(meta.shape, meta.dtype, node_where(graph, node.node_id), f"attribute {layer.target!r}", CodegenError)
    tensor = fresh_tensor(layer.target, tuple(meta.shape), getattr(torch, meta.dtype))
    return nn.Parameter(tensor) if node.parameter_size > 0 else tensor


def fresh_tensor(target: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A freshly initialised weight or buffer for a get_attr with no source (an export-route graph rebuilt
    from its file: the operators are ATen calls, no module's constructor initialises them). Never
    `torch.empty`: a package trained from the seed would start from garbage (NaN losses). Drawn from the
    global RNG in graph order, so every rank seeded alike builds the same values; the usual defaults by
    name: biases, BatchNorm means and counters 0, norm scales and running variances 1, matrices and
    kernels uniform(+-1/sqrt(fan_in)) (nn.Linear's), other tensors (ViT's cls_token, pos_embed) N(0, 0.02)."""
    def named(*leaves: str) -> bool:  # `a.b.bias` (a target) or `a_b_bias` (its layer name)
        return any(target == leaf or target.endswith(("." + leaf, "_" + leaf)) for leaf in leaves)

    if not dtype.is_floating_point or named("bias", "running_mean", "num_batches_tracked"):
        return torch.zeros(shape, dtype=dtype)
    if named("running_var") or (named("weight") and len(shape) == 1):
        return torch.ones(shape, dtype=dtype)
    if named("weight") and len(shape) >= 2:
        bound = 1.0 / math.sqrt(max(1, math.prod(shape[1:])))
        return torch.empty(shape, dtype=dtype).uniform_(-bound, bound)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02)


def layer_of(graph: Graph, node: Node) -> LayerSpec:
    if node.layer is None:
        raise CodegenError(f"{node_where(graph, node.node_id)} has no layer spec; run codegen.infer.infer_layers(graph) first")
    return node.layer
