"""Trace a model with `torch.export` (the route for Hugging Face and timm models fx cannot trace).

`torch.fx.symbolic_trace` runs `forward` on proxies, so `**kwargs` forwards, mask-building code that
inspects tensor values, and optional arguments defeat it. `torch.export.export(..., strict=False)`
runs `forward` on fake tensors instead and records the ATen operators it dispatches (the training
IR: no decompositions, so `aten.linear`, `aten.layer_norm`, `aten.scaled_dot_product_attention`
stay whole). `ep.module()` gives back an fx GraphModule whose parameters and buffers are get_attr
nodes under their state-dict names; this module turns it into a plain GraphModule the profiler
records like an fx trace:

- inputs are the flattened positional then keyword example inputs (placeholders `input_ids`,
  `attention_mask`, ...); the output is the model's structure with `ModelOutput`s as dicts;
- export's guard call and shape assertions (no results, nothing to rebuild) are dropped;
- a parameter read by several operators gets one get_attr node per reader, named by the module
  the reader runs in and placed just before it (export reads every parameter at the top), so tied weights (GPT-2's `transformer.wte.weight` / `lm_head.weight`, which
  export reads under one name) show up as ties (`codegen.ties`) instead of a weight sent between
  stages as an activation;
- `aten.__and__`-style operators become their named equivalents (`aten.bitwise_and`): graph files
  refuse dunder names;
- a parameter or buffer an operator updates in place (`aten.batch_norm`'s running statistics,
  `num_batches_tracked.add_(1)`) is marked `meta["uncrossable"]` on its read: sent to another stage,
  the update would land on the received copy, never on the stage's own buffer;
- an update no later operator reads (BatchNorm's `num_batches_tracked.add_(1)`, which export records
  before the module's operator, with no edge to the rest) moves, with its reads, to just after the
  last operator that reads the same module's state: the optimizer keeps such a side effect with the
  node before it in file order (`optimizer/workload.py`), so the counter stays with its BatchNorm.

Export also writes the device it traced on into operators (`aten.arange(8, device=cpu)`, GPT-2's
`.to(inputs_embeds.device)`): `portable_devices` records that device as "the device the stage runs
on" in the graph, and `retarget_devices` points a traced GraphModule at another device (a model
traced on meta, run on real tensors).

Mode-dependent arguments are fixed at export time: `aten.dropout(x, p, train)` and
`aten.batch_norm(..., training, ...)` keep the mode the model was exported in (the profiler
exports in training mode).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from model_parallel.errors import ProfileError
from model_parallel.graph.arguments import RUN_DEVICE, encode_argument
from model_parallel.graph.core import Graph

logger = logging.getLogger(__name__)

# Export's checks: they return nothing and guard shapes the trace was specialised to.
_ASSERTIONS = ("_assert_tensor_metadata", "_assert_async", "_assert_scalar", "sym_constrain_range",
               "sym_constrain_range_for_size", "_functional_assert_async")
# Python operators export records by their dunder ATen names, and the named ops that compute the same.
# Operators that update buffers in place although their schema does not say so (CompositeImplicit ops):
# argument names they write in training mode.
_IMPLICIT_WRITES = {"batch_norm": ("running_mean", "running_var"), "instance_norm": ("running_mean", "running_var")}
_DUNDER_OPS = {"__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
               "__lshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift"}


@contextmanager
def _without_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face models return a `DynamicCache` when `config.use_cache`: a Python object, not
    tensors, which export cannot return. A training pipeline never wants it: off while tracing, on
    every config the model holds (T5's encoder and decoder stacks keep copies of their own)."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False) is True}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


# Mixture-of-Experts kernels transformers may pick by default, that run a custom op (grouped_mm calls
# torch.ops.transformers.grouped_mm_fallback on the CPU): a graph file cannot name it. batched_mm computes
# the same products with ATen operators (gather the routed experts' weights, then bmm), routing included.
TRACEABLE_EXPERTS = "batched_mm"
_TRACEABLE = ("eager", TRACEABLE_EXPERTS)


@contextmanager
def _traceable_experts(model: nn.Module) -> Iterator[None]:
    """Trace a Hugging Face MoE model with the `batched_mm` experts implementation, restored afterwards."""
    getter = getattr(model, "get_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    try:
        current = getter() if callable(getter) and callable(setter) else None
    except Exception:  # noqa: BLE001 - a model without experts has no implementation to change
        current = None
    if not current or not any(_uses_experts(m) for m in model.modules()) \
            or all(value in _TRACEABLE for value in current.values()):
        yield
        return
    logger.warning("profiling %s with experts_implementation=%r instead of %s: %s runs a custom op a graph cannot "
                   "rebuild; batched_mm computes the same experts (data-dependent routing included) with ATen operators",
                   type(model).__name__, TRACEABLE_EXPERTS, current, current.get(""))
    setter(TRACEABLE_EXPERTS)
    try:
        yield
    finally:
        setter(current)


def _uses_experts(module: nn.Module) -> bool:
    # What transformers' `@use_experts_implementation` sets on an experts module: it dispatches by the config.
    return all(hasattr(module, a) for a in ("_is_expert_parallel", "is_concatenated", "has_gate"))


def export_model(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    """`model` traced by torch.export on `args` / `kwargs`, as a plain fx GraphModule whose forward takes
    the flattened inputs (positional first, then keyword in the given order); also returns those inputs."""
    name = type(model).__name__
    try:
        with _without_cache(model), _traceable_experts(model):
            exported = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception as error:  # export raises many types (UserError, GuardOnDataDependentSymNode, ...)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ProfileError(
            f"torch.export could not trace {name}: {type(error).__name__}: {first[:300]}. "
            "If Python control flow depends on tensor values there, rewrite it with torch.cond or torch.where, "
            "or profile with route='fx' and pass the offending submodule classes as leaf_modules=[...]"
        ) from error
    gm = exported.module()
    graph = gm.graph
    logger.info("torch.export traced %s: %d nodes", name, len(graph.nodes))
    graph._codegen = fx.graph.CodeGen()  # plain flat inputs and outputs instead of export's pytree calling convention
    _drop_checks(graph, name)
    _restructure_output(graph, exported.call_spec.out_spec, name)
    _rename_dunder_ops(graph)
    graph.eliminate_dead_code()  # get_attr of names export did not use (the second name of a tied weight)
    _one_read_per_user(graph, model)
    _mark_updated_in_place(graph)
    _updates_after_their_module(graph)
    graph.lint()
    gm.recompile()
    flat_inputs = tuple(pytree.tree_leaves((tuple(args), dict(kwargs))))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat_inputs):
        raise ProfileError(f"torch.export traced {name} with {len(placeholders)} input(s) "
                           f"({', '.join(p.name for p in placeholders)}) but {len(flat_inputs)} example tensor(s) "
                           "were given; pass only tensors as example inputs (set flags like use_cache on the config)")
    return gm, flat_inputs


def _drop_checks(graph: fx.Graph, name: str) -> None:
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target._schema.name.split("::")[-1] in _ASSERTIONS and not node.users:
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op == "call_module" or isinstance(node.target, torch._ops.HigherOrderOperator):
            what = node.target if node.op == "call_module" else node.target.name()
            stack = list(node.meta.get("nn_module_stack", {}).values())
            where, cls = (stack[-1][0] or name, str(stack[-1][1]).rpartition(".")[2]) if stack else (name, name)
            raise ProfileError(
                f"torch.export traced {name} into a nested graph at node {node.name} ({what}, in module "
                f"{where}): it comes from a torch.no_grad/enable_grad/autocast region or torch.cond inside "
                "forward, which a stage cannot rebuild operator by operator. Remove that region from forward "
                f"(profile in the mode you train in), or profile with route='fx' and leaf_modules=[{cls}]"
            )
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.namespace != "aten":
            raise ProfileError(_custom_op_refusal(node, name))
        if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload) \
                and node.target.__module__ not in ("_operator", "operator"):
            raise ProfileError(f"torch.export traced {name} to node {node.name} calling {node.target!r}, "
                               "which is not an ATen operator; profile with route='fx' instead")


def _custom_op_refusal(node: fx.Node, name: str) -> str:
    """Why a custom operator (not ATen) cannot be in a graph, and the fix for where it comes from."""
    op = f"torch.ops.{node.target.namespace}.{node.target._schema.name.split('::')[-1]}"
    stack = list(node.meta.get("nn_module_stack", {}).values())
    where = f" in module {stack[-1][0]} ({str(stack[-1][1]).rpartition('.')[2]})" if stack else ""
    if node.target.namespace == "transformers":  # an experts kernel batched_mm did not replace
        fix = ("call model.set_experts_implementation('batched_mm') before profiling: ATen operators, the same "
               "results, data-dependent routing included")
    else:
        fix = ("write that computation with torch operators in forward (a stage rebuilt from a graph file may only "
               "call ATen operators; register_functions takes Python functions, not operators)")
    return (f"torch.export traced {name} to node {node.name} calling the custom operator {op}{where}, which a graph "
            f"file cannot name, so no stage could run it; {fix}")


def _structure(spec: pytree.TreeSpec, leaves: Iterator[Any], name: str) -> Any:
    """The model's output rebuilt from export's output spec with the output nodes as leaves:
    dict-like outputs (ModelOutput) become dicts, tuples and lists stay."""
    if spec.is_leaf():
        return next(leaves)
    kind = spec.type
    specs = spec.children() if hasattr(spec, "children") else spec.children_specs
    children = [_structure(child, leaves, name) for child in specs]
    if isinstance(kind, type) and issubclass(kind, Mapping):  # dict, OrderedDict, transformers' ModelOutput
        return {str(key): value for key, value in zip(spec.context, children)}
    if isinstance(kind, type) and issubclass(kind, (tuple, list)):
        return list(children) if issubclass(kind, list) else tuple(children)
    if kind is type(None):
        return None
    raise ProfileError(f"{name} returns a {getattr(kind, '__name__', kind)}, which a graph cannot describe; "
                       "return tensors, tuples, lists or dicts of them (wrap the model to convert its output)")


def _restructure_output(graph: fx.Graph, out_spec: pytree.TreeSpec, name: str) -> None:
    output = next(n for n in graph.nodes if n.op == "output")
    flat = output.args[0]
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    value = _structure(out_spec, iter(flat), name)
    graph.erase_node(output)
    graph.output(value)


def _rename_dunder_ops(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            packet = node.target._schema.name.split("::")[-1]
            if packet in _DUNDER_OPS:
                overload = node.target._overloadname
                replacement = getattr(getattr(torch.ops.aten, _DUNDER_OPS[packet]), overload, None)
                if replacement is None:
                    raise ProfileError(f"node {node.name}: no named ATen operator computes aten.{packet}.{overload}")
                node.target = replacement


def _innermost_module(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return stack[-1][0] if stack else ""


def _one_read_per_user(graph: fx.Graph, model: nn.Module) -> None:
    """Give every reader of a parameter/buffer its own get_attr node, under the name (of a tensor's
    several names) whose module the reader runs in."""
    names_of: dict[int, list[str]] = {}
    for key, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names_of.setdefault(id(tensor), []).append(key)
    by_name = {key: names for names in names_of.values() for key in names}
    for node in list(graph.nodes):
        if node.op != "get_attr" or len(node.users) < 2 and len(by_name.get(str(node.target), ())) < 2:
            continue
        names = by_name.get(str(node.target), [str(node.target)])
        for index, user in enumerate(list(node.users)):
            target = _name_for(user, names, str(node.target))
            if index == 0 and target == node.target:
                continue
            with graph.inserting_before(user):
                read = graph.get_attr(target)
            read.meta.update(node.meta)
            user.replace_input_with(node, read)
        if not node.users:
            graph.erase_node(node)
    # Export reads every parameter at the top of the graph; fx reads each where it is used. Reading it
    # just before its (single) user keeps a contiguous split from sending weights between stages.
    for node in list(graph.nodes):
        if node.op == "get_attr" and len(node.users) == 1:
            next(iter(node.users)).prepend(node)


def _name_for(user: fx.Node, names: list[str], default: str) -> str:
    module = _innermost_module(user)
    matching = [n for n in names if n.rpartition(".")[0] == module]
    return matching[0] if matching else default


def _written_arguments(node: fx.Node) -> list[Any]:
    """The arguments `node`'s ATen schema says it writes to (`Tensor(a!)`)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    written = []
    implicit = _IMPLICIT_WRITES.get(node.target._schema.name.split("::")[-1], ())
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write or argument.name in implicit:
            written.append(node.args[index] if index < len(node.args) else node.kwargs.get(argument.name))
    return written


def _mark_updated_in_place(graph: fx.Graph) -> None:
    for node in graph.nodes:
        for value in _written_arguments(node):
            if isinstance(value, fx.Node) and value.op == "get_attr":
                op = node.target._schema.name.split("::")[-1]
                value.meta["uncrossable"] = (f"{value.target} is updated in place by {node.name} (aten.{op}); "
                                             "the update must run on the stage that holds it")


def _updates_after_their_module(graph: fx.Graph) -> None:
    """Move each in-place update of a parameter/buffer that nothing reads afterwards, with its reads,
    to just after the last other operator that reads state of the same module."""
    nodes = list(graph.nodes)
    for node in nodes:
        if node.users or not _written_arguments(node) \
                or not all(i.op == "get_attr" and len(i.users) == 1 for i in node.all_input_nodes):
            continue
        modules = {str(i.target).rpartition(".")[0] for i in node.all_input_nodes}
        if len(modules) != 1:
            continue
        module = modules.pop()
        owners = [n for n in nodes if n is not node and n.op == "call_function"
                  and any(i.op == "get_attr" and str(i.target).rpartition(".")[0] == module for i in n.all_input_nodes)]
        if not owners:
            continue
        place = owners[-1]
        for read in node.all_input_nodes:
            place.append(read)
            place = read
        place.append(node)


def portable_devices(graph: Graph, traced_on: torch.device) -> Graph:
    """The graph with every device argument equal to the device the model was traced on recorded as
    `{"device": "run"}` (graph.arguments.RUN_DEVICE): a graph traced on meta or on the CPU then runs on
    the device each stage is placed on. Other devices (a model's explicit `device="cpu"`) stay."""
    traced, run = encode_argument(traced_on, lambda _: None), {"device": RUN_DEVICE}

    def swap(value: Any) -> Any:
        if value == traced:
            return run
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return type(value)(swap(v) for v in value) if isinstance(value, (list, tuple)) else value

    nodes = []
    for node in graph.nodes:
        layer = node.layer
        if layer is not None:
            args, kwargs = swap(layer.args), swap(layer.kwargs)
            if (args, kwargs) != (layer.args, layer.kwargs):
                node = replace(node, layer=replace(layer, args=args, kwargs=kwargs))
        nodes.append(node)
    return replace(graph, nodes=tuple(nodes))


def retarget_devices(gm: fx.GraphModule, old: torch.device, new: torch.device) -> list[fx.Node]:
    """Put `new` in place of the device argument `old` in `gm`'s operators (a model traced on meta is
    profiled on real tensors); returns the nodes changed."""
    on_new = lambda v: new if isinstance(v, torch.device) and v == old else v  # noqa: E731
    changed = []
    for node in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate(node.args, on_new), fx.node.map_aggregate(node.kwargs, on_new)
        if (args, kwargs) != (node.args, node.kwargs):
            node.args, node.kwargs = args, kwargs
            changed.append(node)
    if changed:
        gm.recompile()
    return changed
