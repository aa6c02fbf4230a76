"""Build runnable stage modules (torch.fx GraphModules) from a graph's layer specs, in memory.

This is the one place a graph's text becomes code: the runtime builds its stage with
`build_stage`, live migration rebuilds stages from any range of layers (handing over the existing
module objects through `modules=` so nothing is copied), and the package generator prints the
very same fx graphs as source files. Every layer is first checked by `graph.loader` (closed
allow-lists of constructors, functions and tensor methods decided by code, literal arguments only),
so a graph file can never run code: anything else is refused with a GraphFormatError naming the
node before any layer is built.
"""
from __future__ import annotations

import linecache
import operator
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch.fx as fx
from torch import nn

from model_parallel.codegen.aliasing import mutated_inputs
from model_parallel.codegen.boundary import StageBoundary, is_model_input, model_output_ids, stage_boundaries
from model_parallel.codegen.layers import ModulesArg, layer_of, make_attribute, make_module, node_where
from model_parallel.codegen.modes import follow_mode
from model_parallel.codegen.ties import tie_stage, tie_stages
from model_parallel.errors import CodegenError, GraphError, PlanError
from model_parallel.graph import loader
from model_parallel.graph.arguments import CONSTANTS, OutputDict, decode_argument
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan


class StageModule(fx.GraphModule):
    """One pipeline stage: `forward(*inputs)` takes the boundary inputs in order and returns a tuple
    of the boundary outputs in order. `input_names` / `output_names` are node ids; `node_ids` are the
    graph nodes the stage computes, in topological order."""

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        class_name: str = "StageModule",
        input_names: Sequence[str] = (),
        output_names: Sequence[str] = (),
        node_ids: Sequence[str] = (),
    ) -> None:
        super().__init__(root, graph, class_name)
        # GraphModule copies buffers as persistent ones: constants stay out of the state dict, as in the root.
        self._non_persistent_buffers_set.update(getattr(root, "_non_persistent_buffers_set", set()) & set(self._buffers))
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.node_ids = tuple(node_ids)

    def recompile(self) -> Any:
        """torch.fx's own, then the generated source's cache entries are tied to this module: fx keeps every
        source it ever compiled (its loader and linecache, for tracebacks) for the life of the process, and a
        run rebuilds its stages at every plan switch, recovery and admission (a rank's heap grew ~1 KB a switch
        on a tiny MLP, the size of the stage's source on a large one). Dropped with the module."""
        result = super().recompile()
        keys = self.__dict__.get("_source_keys")
        if keys is None:
            keys = self.__dict__["_source_keys"] = []
            weakref.finalize(self, _forget_sources, keys)
        keys.append(type(self).forward.__code__.co_filename)
        return result

    def __deepcopy__(self, memo: dict) -> "StageModule":
        copied = super().__deepcopy__(memo)
        copied.input_names, copied.output_names, copied.node_ids = self.input_names, self.output_names, self.node_ids
        return copied


def _forget_sources(keys: list[str]) -> None:
    cache = getattr(getattr(fx.graph_module, "_loader", None), "eval_cache", {})  # torch.fx's private source cache
    for key in keys:
        cache.pop(key, None)
        linecache.cache.pop(key, None)


def check_shared_modules(graph: Graph, stage_of: Mapping[str, int]) -> None:
    """A module with parameters called from two stages cannot be split: its weights would diverge.
    (Tied parameters - one tensor under two names, found by identity - can: see codegen/ties.py.)"""
    stages_of_target: dict[str, set[int]] = {}
    owns_state: set[str] = set()
    for node in graph.nodes:
        if node.layer is not None and node.layer.op in ("call_module", "get_attr"):
            stages_of_target.setdefault(node.layer.target, set()).add(int(stage_of[node.node_id]))
            if node.layer.parameters:
                owns_state.add(node.layer.target)
    for target, stages in stages_of_target.items():
        if len(stages) > 1 and target in owns_state:
            users = [n.node_id for n in graph.nodes if n.layer is not None and n.layer.target == target]
            raise CodegenError(
                f"module {target!r} (nodes {', '.join(users)}) is used by stages {sorted(stages)} and has "
                "parameters: keep them in one stage (move those nodes together)"
            )


# ---- stages -------------------------------------------------------------------------------------
def check_layers(
    graph: Graph, node_ids: Optional[Sequence[str]] = None, *, modules: ModulesArg = None,
    source_model: Optional[nn.Module] = None,
) -> None:
    """Refuse a graph asking for anything outside `graph.loader`'s allow-lists (GraphFormatError naming
    the node), before any layer is built. Modules handed over in `modules` are not constructed, so their
    expressions are only checked for form; `source_model` is a model this process holds, so its classes
    are allowed."""
    if source_model is not None:
        loader.allow_model(source_model)
    ids = list(node_ids) if node_ids is not None else list(graph.topological_order)
    handed_over = []
    if modules is not None:
        for node_id in ids:
            layer = graph[node_id].layer
            if layer is not None and layer.op == "call_module":
                if isinstance(modules.get(graph.attribute_names[layer.target], modules.get(layer.target)), nn.Module):
                    handed_over.append(node_id)
    loader.check_graph(graph, ids, handed_over=handed_over)
    loader.guard_sparse(graph, ids)


def ensure_layers(graph: Graph) -> Graph:
    if all(n.layer is not None for n in graph.nodes):
        return graph
    from model_parallel.codegen.infer import infer_layers

    return infer_layers(graph)


def _build_fx(
    graph: Graph,
    node_ids: Sequence[str],
    inputs: Sequence[str],
    output_value: Any,
    *,
    modules: ModulesArg,
    source_model: Optional[nn.Module],
    check_sharing: bool,
) -> tuple[nn.Module, fx.Graph]:
    """Root module (layers as attributes) and fx graph computing `node_ids` from `inputs`;
    `output_value(env)` gives the fx output argument."""
    check_layers(graph, node_ids, modules=modules, source_model=source_model)  # refuse before building anything
    members = set(node_ids)
    root = nn.Module()
    fx_graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    built: dict[str, nn.Module] = {}  # node id -> module (in-place detection)

    if check_sharing:
        for node_id in node_ids:
            layer = graph[node_id].layer
            if layer is not None and layer.op in ("call_module", "get_attr"):
                others = [n.node_id for n in graph.nodes if n.layer is not None and n.layer.target == layer.target
                          and n.node_id not in members]
                owns = any(graph[o].layer.parameters for o in others) or bool(layer.parameters)
                if others and owns:
                    raise CodegenError(
                        f"module {layer.target!r} is used by node {node_id} of this stage and by node(s) "
                        f"{', '.join(others)} outside it, and has parameters: keep them in one stage"
                    )

    for node_id in node_ids:  # modules first: in-place detection needs them
        node = graph[node_id]
        layer = layer_of(graph, node)
        if layer.op == "call_module":
            name = graph.attribute_names[layer.target]
            if not hasattr(root, name):
                root.add_module(name, make_module(graph, node, modules=modules, source_model=source_model))
            built[node_id] = getattr(root, name)
        elif layer.op == "get_attr":
            name = graph.attribute_names[layer.target]
            if not hasattr(root, name):
                tensor = make_attribute(graph, node, modules=modules, source_model=source_model)
                if isinstance(tensor, nn.Parameter):
                    root.register_parameter(name, tensor)
                else:  # a constant stays out of the state dict, as in the original model
                    root.register_buffer(name, tensor, persistent=layer.target not in (graph.metadata.get(CONSTANTS) or {}))
    tie_stage(graph, node_ids, root)  # layers built separately: point each tie's attributes at one tensor

    for name in inputs:
        env[name] = fx_graph.placeholder(graph.variable_names[name])
        env[name].meta["node_id"] = name
    for name in sorted(mutated_inputs(graph, node_ids, inputs, built), key=list(inputs).index):
        env[name] = _clone_on_entry(fx_graph, env[name], name, len(layer_of(graph, graph[name]).outputs))

    def resolve(ref: str, where: str) -> fx.Node:
        if ref not in env:
            raise CodegenError(
                f"{where} needs {ref!r}, which is neither computed earlier in this stage nor one of its "
                f"inputs ({', '.join(inputs) or 'none'}); check the stage boundary"
            )
        return env[ref]

    device: list[fx.Node] = []

    def run_device() -> fx.Node:
        """`<first input>.device`, read once: every input arrives on the device the stage runs on."""
        if not device:
            if not inputs:
                raise CodegenError(f"{where}: an operator takes the device the stage runs on, and this stage has no "
                                   "input to read it from; move the operator into a stage with inputs")
            device.append(fx_graph.call_function(getattr, (env[inputs[0]], "device")))
            device[0].meta["comment"] = "the device this stage runs on (the graph records it as 'run')"
        return device[0]

    mode: list[fx.Node] = []

    def training(fx_graph: fx.Graph) -> fx.Node:
        """`self.training`, read once: the mode a trace fixed to training follows the stage's (codegen/modes.py)."""
        if not mode:
            mode.append(fx_graph.get_attr("training"))
            mode[0].meta["comment"] = "the stage's mode: dropout and batch statistics in training only"
        return mode[0]

    for node_id in node_ids:
        node = graph[node_id]
        layer = layer_of(graph, node)
        where = node_where(graph, node_id)
        if layer.op == "placeholder":
            if node_id not in env:
                raise CodegenError(f"{where}: model input {node_id} is in this stage but not among its inputs")
            continue
        try:
            args = tuple(decode_argument(a, lambda ref: resolve(ref, where), run_device) for a in layer.args)
            kwargs = {k: decode_argument(v, lambda ref: resolve(ref, where), run_device) for k, v in layer.kwargs.items()}
        except GraphError as error:
            raise CodegenError(f"{where}: {error}") from None
        if layer.op == "call_function":
            target: Any = loader.function_target(layer.target, tuple(layer.args), where)
        elif layer.op == "call_method":
            target = loader.check_method(layer.target, where)
        else:
            target = graph.attribute_names[layer.target]
        if layer.op in ("call_function", "call_method"):  # literals a trace fixed to training mode follow the stage's
            args, kwargs = follow_mode(layer.target, args, kwargs, training, fx_graph)
        fx_node = fx_graph.create_node(layer.op, target, args, kwargs, name=graph.variable_names[node_id])
        fx_node.meta["node_id"] = node_id
        fx_node.meta["outputs"] = layer.outputs
        env[node_id] = fx_node

    fx_graph.output(output_value(lambda ref: resolve(ref, "the stage output")))
    fx_graph.lint()
    return root, fx_graph



def _clone_on_entry(fx_graph: fx.Graph, value: fx.Node, name: str, tensors: int) -> fx.Node:
    """A received input that an op of the stage modifies in place (directly or through a view), cloned.

    A node with several tensor outputs (topk's values and indices, split's chunks) arrives as a tuple of
    them: each element is cloned and the tuple rebuilt, so `getitem` below reads the copies (Mixtral's
    router normalises topk's values in place). fx cannot print a pytree helper's class argument, and the
    generated packages import only torch, hence the unrolled form. A container the outputs miscount
    (None or a non-tensor among them) fails loudly on `.clone`, never silently."""
    comment = "cloned: an op below modifies it in place, and autograd forbids that on a received input"
    if tensors <= 1:
        clone = fx_graph.call_method("clone", (value,))
    else:
        parts = []
        for index in range(tensors):
            part = fx_graph.call_function(operator.getitem, (value, index))
            parts.append(fx_graph.call_method("clone", (part,)))
            parts[-1].meta["node_id"] = name
        clone = fx_graph.call_function(tuple, (parts,))
    clone.meta.update(node_id=name, comment=comment)
    return clone


def build_stage(
    graph: Graph,
    node_ids: Sequence[str],
    boundary: StageBoundary,
    *,
    modules: ModulesArg = None,
    source_model: Optional[nn.Module] = None,
    class_name: str = "StageModule",
) -> StageModule:
    """A module computing `node_ids` (any order; run in topological order) from `boundary.inputs`,
    returning the tuple `boundary.outputs`.

    Layers are attributes named `graph.attribute_names[target]`, taken from `modules` (keyed by layer name or
    original target) when given, else built from their constructor expression, else taken from
    `source_model`. Fresh layers are randomly initialised: load weights with
    `stage.load_state_dict(stage_state_from_original(graph, model.state_dict()), strict=False)`.
    """
    graph = ensure_layers(graph)
    missing = [n for n in node_ids if n not in graph]
    if missing:
        raise CodegenError(f"stage names node(s) not in the graph: {missing[:5]}")
    members = set(node_ids)
    ordered = tuple(n for n in graph.topological_order if n in members)
    root, fx_graph = _build_fx(
        graph, ordered, boundary.inputs,
        lambda resolve: tuple(resolve(name) for name in boundary.outputs),
        modules=modules, source_model=source_model, check_sharing=True,
    )
    return StageModule(root, fx_graph, class_name, boundary.inputs, boundary.outputs, ordered)


def stage_assignment(graph: Graph, stage_of_or_plan: Union[Plan, Mapping[str, int]]) -> dict[str, int]:
    """Node id -> stage from a Plan or a mapping (a plan must cover every node of the graph)."""
    stage_of = stage_of_or_plan.stage_of if isinstance(stage_of_or_plan, Plan) else dict(stage_of_or_plan)
    missing = [n.node_id for n in graph.nodes if n.node_id not in stage_of]
    if missing:
        raise PlanError(f"the plan gives no stage to {len(missing)} node(s) of the graph, e.g. {missing[:3]}")
    return {k: int(v) for k, v in stage_of.items()}


def build_stages(
    graph: Graph,
    stage_of_or_plan: Union[Plan, Mapping[str, int]],
    *,
    modules: ModulesArg = None,
    source_model: Optional[nn.Module] = None,
) -> list[StageModule]:
    """Every stage of a plan (or node -> stage map), as `build_stage` builds them (classes Stage0, Stage1, ...)."""
    graph = ensure_layers(graph)
    stage_of = stage_assignment(graph, stage_of_or_plan)
    check_layers(graph, modules=modules, source_model=source_model)  # every stage's layers, before the first is built
    boundaries = stage_boundaries(graph, stage_of)
    check_shared_modules(graph, stage_of)
    stages = []
    for index, boundary in enumerate(boundaries):
        node_ids = tuple(n for n in graph.topological_order if stage_of[n] == index)
        stages.append(build_stage(graph, node_ids, boundary, modules=modules, source_model=source_model,
                                  class_name=f"Stage{index}"))
    tie_stages(graph, stages)  # a tie split across these stages stays one Parameter, as in the model
    return stages


def full_model_from_graph(
    graph: Graph, *, modules: ModulesArg = None, source_model: Optional[nn.Module] = None
) -> StageModule:
    """The whole model as one module: takes the model inputs, returns the model outputs in the
    structure the original model returned them (`graph.metadata["outputs"]`)."""
    graph = ensure_layers(graph)
    inputs = tuple(n for n in graph.topological_order if is_model_input(graph[n]))
    outputs = model_output_ids(graph)
    encoded = graph.metadata.get("outputs")

    def output_value(resolve: Any) -> Any:
        if encoded is None:
            return resolve(outputs[0]) if len(outputs) == 1 else tuple(resolve(o) for o in outputs)
        return decode_argument(encoded, resolve)

    root, fx_graph = _build_fx(graph, graph.topological_order, inputs, output_value,
                               modules=modules, source_model=source_model, check_sharing=False)
    output = next(n for n in fx_graph.nodes if n.op == "output")
    if isinstance(output.args[0], Mapping):  # fx returns plain dicts: keep `out.logits` working (OutputDict)
        with fx_graph.inserting_before(output):
            output.args = (fx_graph.call_function(OutputDict, (dict(output.args[0]),)),)
    return StageModule(root, fx_graph, str(graph.metadata.get("model", "FullModel")), inputs, outputs,
                       graph.topological_order)
