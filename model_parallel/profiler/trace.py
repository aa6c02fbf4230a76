"""Turn an unmodified model into an operator `Graph`: structure, layer specs and sizes.

Two routes (`trace_model(route=...)`, recorded in `graph.metadata["route"]`): torch.fx's
symbolic trace (torch-level ops and leaf modules; our zoo and torchvision models), and torch.export
(`profiler.export_trace`: ATen ops; Hugging Face models, keyword inputs, and whatever fx fails on).

Timing is added by `model_parallel.profiler.timing`; this module only captures what the model
computes: one node per fx node (leaf module call, function, tensor method, attribute), the real
dataflow edges (residual adds, concatenations, in-place ops included: fx records `out += identity`
as an `operator.add` node with both inputs), and activation/parameter bytes from real tensors.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import _get_qualified_name

from model_parallel.errors import ModelParallelError, ProfileError
from model_parallel.graph.arguments import CONSTANTS, encode_argument, encode_constant
from model_parallel.graph.crossing import value_refusal
from model_parallel.graph.core import STATE_ALIASES, TIED_PARAMETERS, Graph, LayerSpec, Node, TensorMeta
from model_parallel.graph.hf_config import HF_CONFIG, hf_config_dict
from model_parallel.graph.init_rule import is_hugging_face_model
from model_parallel.profiler.describe import describe, module_constructor
from model_parallel.profiler.export_trace import export_model, portable_devices

logger = logging.getLogger(__name__)
ROUTES = ("auto", "fx", "export")


class LeafTracer(fx.Tracer):
    """fx's tracer, plus user-chosen module classes kept whole (not traced through)."""

    def __init__(self, leaf_modules: Sequence[type[nn.Module]] = ()) -> None:
        super().__init__()
        self.extra_leaves = tuple(leaf_modules)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.extra_leaves and isinstance(m, self.extra_leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def symbolic_trace(model: nn.Module, leaf_modules: Sequence[type[nn.Module]] = ()) -> fx.GraphModule:
    tracer = LeafTracer(leaf_modules)
    with attributes_unchanged(model):  # the GraphModule keeps the constants fx hung on the model
        try:
            graph = tracer.trace(model)
        except Exception as error:  # fx raises many types (TraceError, TypeError, ...); report them all the same way
            raise ProfileError(
                f"torch.fx could not trace {type(model).__name__}: {type(error).__name__}: {error}. "
                "Pass the offending submodule classes as leaf_modules=[...] so they are profiled whole."
            ) from error
        return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _attribute_names(model: nn.Module) -> dict[int, tuple[nn.Module, set[str]]]:
    return {id(m): (m, set(vars(m)) | set(m._parameters) | set(m._buffers) | set(m._modules)) for m in model.modules()}


@contextmanager
def attributes_unchanged(model: nn.Module) -> Iterator[None]:
    """Remove, on the way out, every attribute tracing added to `model` or its submodules: fx's tracer
    stores each tensor `forward` creates (timm Swin's masks) as `root._tensor_constantN`, so the user's
    model would grow attributes and a second trace would number its nodes differently."""
    before = _attribute_names(model)
    try:
        yield
    finally:
        for key, (module, names) in _attribute_names(model).items():
            for name in names - before.get(key, (module, names))[1]:
                for table in (module._parameters, module._buffers, module._modules):
                    table.pop(name, None)
                module._non_persistent_buffers_set.discard(name)
                vars(module).pop(name, None)


# ---- tracing --------------------------------------------------------------------------------------
def tensor_metas(value: Any) -> tuple[TensorMeta, ...]:
    """Shapes and dtypes of the tensors in a node's output (nested tuples/lists flattened)."""
    if isinstance(value, torch.Tensor):
        return (TensorMeta(tuple(value.shape), str(value.dtype).removeprefix("torch.")),)
    if isinstance(value, (tuple, list)):
        return tuple(m for v in value for m in tensor_metas(v))
    return ()


def _nbytes(meta: TensorMeta) -> float:
    return float(meta.numel * torch.empty((), dtype=getattr(torch, meta.dtype)).element_size())


def _target_text(node: fx.Node) -> str:
    if node.op == "call_function":
        return _get_qualified_name(node.target).replace("_operator.", "operator.")
    return str(node.target)


class _Recorder(fx.Interpreter):
    """Runs the traced model once, remembering each node's output tensor metadata."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.metas: dict[str, tuple[TensorMeta, ...]] = {}
        self.refusals: dict[str, str] = {}  # node -> why its value cannot cross a stage boundary

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.metas[n.name] = tensor_metas(result)
        why = value_refusal(result)
        if why is not None:
            self.refusals[n.name] = why
        return result


def run_preserving_state(model: nn.Module, fn: Any) -> Any:
    """Call `fn()` and then restore every buffer (BatchNorm statistics) it may have changed."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        return fn()
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in saved:
                    buffer.copy_(saved[name])


def graph_from_fx(gm: fx.GraphModule, metas: dict[str, tuple[TensorMeta, ...]], metadata: Optional[dict] = None,
                  state_names: Optional[set[str]] = None, refusals: Optional[Mapping[str, str]] = None) -> Graph:
    """Build our Graph from a traced GraphModule and per-node output metadata (zero times).

    `state_names`: the model's state-dict keys. Tensors outside it (non-persistent buffers such as
    Llama's rotary `inv_freq`, constants export lifted) are owned by no node, so state dicts load
    strictly; a get_attr of one is recorded in `metadata["constants"]` (values included when small,
    see `graph.arguments.encode_constant`) so a rebuilt stage gets its real value, never torch.empty.
    `refusals`: node -> why its value cannot cross a stage boundary (`Node.uncrossable`); the export
    route adds its own in `fx_node.meta["uncrossable"]` (buffers updated in place).
    """
    constants: dict[str, Any] = {}
    modules = dict(gm.named_modules())
    fx_nodes = [n for n in gm.graph.nodes if n.op != "output"]
    names = {n: n.name for n in fx_nodes}
    owned: set[str] = set()  # parameter/buffer names already attributed to an earlier node
    nodes: list[Node] = []
    edges: list[tuple[str, str]] = []
    input_index = 0
    outputs: Any = None
    for fx_node in gm.graph.nodes:
        if fx_node.op == "output":
            outputs = encode_argument(fx_node.args[0], lambda v: names.get(v) if isinstance(v, fx.Node) else None)
            continue
        module = modules.get(fx_node.target) if fx_node.op == "call_module" else None
        parameters: list[str] = []
        parameter_bytes = 0.0
        if fx_node.op == "call_module":
            for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                full = f"{fx_node.target}.{name}"
                if state_names is not None and full not in state_names:
                    continue  # a non-persistent buffer: the module's constructor (or the handed-over module) has it
                if full not in owned:
                    owned.add(full)
                    parameters.append(full)
                    if isinstance(tensor, nn.Parameter):
                        parameter_bytes += tensor.numel() * tensor.element_size()
        elif fx_node.op == "get_attr" and fx_node.target not in owned:
            attr = gm
            for part in str(fx_node.target).split("."):
                attr = getattr(attr, part)
            if isinstance(attr, torch.Tensor) and state_names is not None and str(fx_node.target) not in state_names \
                    and not isinstance(attr, nn.Parameter):
                constants[str(fx_node.target)] = encode_constant(attr)
            elif isinstance(attr, torch.Tensor):
                owned.add(str(fx_node.target))
                parameters.append(str(fx_node.target))
                if isinstance(attr, nn.Parameter):
                    parameter_bytes += attr.numel() * attr.element_size()
        node_metas = metas.get(fx_node.name, ())
        activation = tuple(_nbytes(m) for m in node_metas)
        encode = lambda v: names.get(v) if isinstance(v, fx.Node) else None  # noqa: E731
        layer = LayerSpec(
            op=fx_node.op,
            target=_target_text(fx_node),
            args=tuple(encode_argument(a, encode) for a in fx_node.args),
            kwargs={k: encode_argument(v, encode) for k, v in fx_node.kwargs.items()},
            module=module_constructor(module) if module is not None else None,
            outputs=node_metas,
            parameters=tuple(parameters),
        )
        nodes.append(
            Node(
                node_id=fx_node.name,
                description=describe(fx_node, module, input_index),
                activation_size=activation if len(activation) > 1 else (activation[0] if activation else 0.0),
                parameter_size=float(parameter_bytes),
                layer=layer,
                uncrossable=(refusals or {}).get(fx_node.name) or fx_node.meta.get("uncrossable"),
            )
        )
        if fx_node.op == "placeholder":
            input_index += 1
        edges += [(src.name, fx_node.name) for src in fx_node.all_input_nodes]
    meta = {"outputs": outputs, "model": type(gm).__name__, **(metadata or {})}
    if constants:
        meta[CONSTANTS] = constants
    return Graph(nodes=tuple(nodes), edges=tuple(edges), metadata=meta)


def split_inputs(example_inputs: Any, example_kwargs: Optional[Mapping[str, Any]] = None) -> tuple[tuple, dict]:
    """(positional, keyword) example inputs; a dict given as `example_inputs` is the keyword inputs."""
    if isinstance(example_inputs, Mapping):
        if example_kwargs:
            raise ProfileError("give keyword inputs either as a dict in example_inputs or as example_kwargs, not both")
        return (), dict(example_inputs)
    return tuple(example_inputs), dict(example_kwargs or {})


def flat_inputs(example_inputs: Any, example_kwargs: Optional[Mapping[str, Any]] = None) -> tuple[Any, ...]:
    """The values a traced graph's placeholders take, in order: positional inputs, then keyword ones."""
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    return (*args, *kwargs.values())


def trace_model(
    model: nn.Module,
    example_inputs: Any,
    leaf_modules: Sequence[type[nn.Module]] = (),
    *,
    example_kwargs: Optional[Mapping[str, Any]] = None,
    route: str = "auto",
) -> tuple[Graph, fx.GraphModule]:
    """Trace `model` and run it once on the example inputs to record shapes; the model is left unchanged.

    `example_inputs`: a tuple of positional inputs, or a dict of keyword inputs (`example_kwargs`
    adds keyword inputs to positional ones). `route`: "fx" (torch.fx symbolic trace), "export"
    (torch.export), or "auto": export for Hugging Face models and keyword inputs, else fx, falling
    back to export when fx fails. Returns the graph (times zero; `model_parallel.profile` fills them
    in) and the GraphModule, whose forward takes `flat_inputs(example_inputs, example_kwargs)`.
    """
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    if route not in ROUTES:
        raise ProfileError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    if route == "fx" and kwargs:
        raise ProfileError(f"keyword inputs ({', '.join(kwargs)}) need route='export' (or 'auto'): "
                           "torch.fx traces positional inputs only")
    if route == "auto" and (kwargs or is_hugging_face_model(model)):
        why = "keyword inputs" if kwargs else "a Hugging Face model (fx cannot trace its **kwargs forwards)"
        return _trace(model, args, kwargs, leaf_modules, "export", why)
    if route != "auto":
        return _trace(model, args, kwargs, leaf_modules, route, "asked for")
    try:
        graph, gm = _trace(model, args, kwargs, leaf_modules, "fx", "default")
        buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
        lost = sorted((set(model.state_dict()) & buffers) - _covered_names(graph))
        if not lost:
            return graph, gm
        # fx ran a method on a real buffer instead of recording it (timm's BatchNormAct2d does
        # `self.num_batches_tracked.add_(1)`): the graph would not carry that state; export records it.
        raise ProfileError(f"the fx graph of {type(model).__name__} does not use {len(lost)} buffer(s) of its "
                           f"state dict, e.g. {lost[:3]}")
    except ProfileError as fx_error:
        logger.info("torch.fx failed on %s, trying torch.export: %s", type(model).__name__, fx_error)
        try:
            return _trace(model, args, kwargs, leaf_modules, "export", f"torch.fx failed: {str(fx_error)[:200]}")
        except ProfileError as export_error:
            raise ProfileError(f"{fx_error} torch.export failed too: {export_error}") from export_error


def _trace(model: nn.Module, args: tuple, kwargs: dict, leaf_modules: Sequence[type[nn.Module]], route: str,
           why: str) -> tuple[Graph, fx.GraphModule]:
    inputs = (*args, *kwargs.values())
    if route == "export":
        if leaf_modules:
            raise ProfileError("leaf_modules apply to route='fx' only; torch.export records ATen operators")
        gm, inputs = run_preserving_state(model, lambda: export_model(model, args, kwargs))
    else:
        gm = run_preserving_state(model, lambda: symbolic_trace(model, leaf_modules))
    # (Tracing runs the model's Python on its real buffers - timm's BatchNormAct2d counts
    # `num_batches_tracked` outside any op - and the job builder trains the model it traced.)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ProfileError(
            f"{type(model).__name__}.forward takes {len(placeholders)} input(s) "
            f"({', '.join(p.name for p in placeholders)}) but {len(inputs)} example input(s) were given"
        )
    recorder = _Recorder(gm)
    try:
        with torch.no_grad():
            run_preserving_state(model, lambda: recorder.run(*inputs))
    except ModelParallelError:
        raise
    except Exception as error:  # shape mismatches and the like: name the model and the inputs
        shapes = ", ".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs)
        raise ProfileError(
            f"running {type(model).__name__} on the example inputs ({shapes}) failed: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}. Check the input shapes the model expects"
        ) from error
    metadata = {
        "inputs": [{"name": p.name, "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
                   for p, x in zip(placeholders, inputs) if isinstance(x, torch.Tensor)],
        "model": type(model).__name__,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "route": route,
    }
    if route == "export":
        metadata["route_reason"] = why
    config = hf_config_dict(model)
    if config is not None:  # what export writes as config.json, from the graph a checkpoint records
        metadata[HF_CONFIG] = config
    state_names = set(model.state_dict().keys())
    graph = graph_from_fx(gm, recorder.metas, metadata, state_names, recorder.refusals)
    if route == "export":  # export wrote the traced-on device into operators: "wherever it runs" instead
        traced_on = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
        graph = portable_devices(graph, traced_on)
    owned = {name for node in graph.nodes for name in node.layer.parameters}
    # A tie only matters between names nodes own (a tensor used twice inside one leaf module stays whole).
    groups = tied_tensor_names(model)
    ties = [kept for group in groups if len(kept := [n for n in group if n in owned]) > 1]
    if ties:
        graph = replace(graph, metadata={**graph.metadata, TIED_PARAMETERS: ties})
    # Names of a tied tensor that no node reads (export reads one name per reader): the state dict has them.
    aliases = {n: kept[0] for group in groups if (kept := [n for n in group if n in owned]) for n in group if n not in owned}
    if aliases:
        graph = replace(graph, metadata={**graph.metadata, STATE_ALIASES: aliases})
    return graph, gm


def _covered_names(graph: Graph) -> set[str]:
    """State-dict names the graph's nodes own, or that are another name of an owned tensor."""
    owned = {name for node in graph.nodes for name in node.layer.parameters}
    return owned | set(graph.metadata.get(STATE_ALIASES) or {})


def tied_tensor_names(model: nn.Module) -> list[list[str]]:
    """Groups of state-dict names that are one tensor object (GPT-2's `lm_head.weight = transformer.wte.weight`).

    Found by identity, not by name: `named_parameters(remove_duplicate=False)` lists every name of a
    shared Parameter, and fx records each module's own names, so the second user of a tied weight
    would otherwise look like an independent parameter.
    """
    by_id: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(tensor), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
