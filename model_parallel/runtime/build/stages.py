"""What a rank needs to hold its stage: an even starting plan, the layer objects, and who owns which layer.

Every rank builds the whole model from the same seed (so weights agree without a broadcast) and
hands the layer objects to `codegen.build_stage(..., modules=...)`; a stage module therefore
shares its layers with `layer_modules(...)`, and a plan switch rebuilds stages around the very
same objects (only layers arriving from another rank get new values).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Union

import torch
from torch import nn

from model_parallel.codegen.naming import layer_name
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.contiguous import even_stages
from model_parallel.optimizer.memory import Footprint


def even_plan(graph: Graph, num_stages: int, replicas: Optional[Mapping[int, int]] = None,
              memory_per_worker: Optional[float] = None, footprint: Optional[Footprint] = None) -> Plan:
    """`num_stages` contiguous stages of about equal profiled time (parameter bytes where the graph has no
    times): the optimizer's straight solver with unit speeds (`optimizer.contiguous.even_stages`), under
    `memory_per_worker` when given. Model inputs stay in stage 0; ranks in stage order (`replicas` per
    stage, default 1)."""
    return even_stages(graph, num_stages, replicas, memory_per_worker, footprint)


def layer_targets(graph: Graph) -> dict[str, str]:
    """node id -> original target, for nodes that hold a layer (call_module) or an attribute (get_attr)."""
    return {n.node_id: n.layer.target for n in graph.nodes
            if n.layer is not None and n.layer.op in ("call_module", "get_attr")}


def layer_modules(graph: Graph, model: nn.Module) -> dict[str, Union[nn.Module, torch.Tensor]]:
    """Layer name -> the object in `model` (modules for call_module nodes, tensors for get_attr)."""
    from model_parallel.graph.arguments import CONSTANTS

    out: dict[str, Union[nn.Module, torch.Tensor]] = {}
    constants = graph.metadata.get(CONSTANTS) or {}
    for node in graph.nodes:
        if node.layer is None or node.layer.op not in ("call_module", "get_attr"):
            continue
        name = graph.attribute_names[node.layer.target]
        if name in out:
            continue
        # A model rebuilt from a graph (codegen.full_model_from_graph) holds layers flat, by layer name.
        value: Optional[Union[nn.Module, torch.Tensor]] = model._modules.get(name)
        if value is None:
            value = model._parameters.get(name)
        if value is None:
            value = model._buffers.get(name)
        if value is None and node.layer.op == "get_attr" and node.layer.target in constants:
            value = _constant(model, node.layer.target, constants[node.layer.target])
        if value is None:
            value = _by_path(model, node.layer.target, node.node_id, name)
        out[name] = value
    return out


def _constant(model: nn.Module, target: str, record: object) -> Optional[torch.Tensor]:
    """A tensor the graph carries as a constant and `model` does not hold: one `forward` creates
    (`torch.tensor(...)`, an index list; torch.export lifts it), so the graph's value is the value.
    None when the model holds it (a non-persistent buffer: its own object, materialized from the record)."""
    from model_parallel.graph.arguments import decode_constant

    try:
        _by_path(model, target, target)
        return None
    except PlanError:
        pass
    value = decode_constant(record, f"graph constant {target!r}")
    if value is None:  # too large to record: a meta tensor the materializer refuses, naming the constant
        assert isinstance(record, Mapping)  # decode_constant refused anything else
        shape, dtype = record["shape"], getattr(torch, str(record["dtype"]))
        return torch.empty(shape, dtype=dtype, device="meta")
    return value


def _by_path(model: nn.Module, target: str, node_id: str, flat: Optional[str] = None) -> Union[nn.Module, torch.Tensor]:
    """The original model's submodule/parameter/buffer at dotted `target` ("layer1.0.conv1", "0")."""
    value: Union[nn.Module, torch.Tensor] = model
    for depth, part in enumerate(target.split(".")):
        children = getattr(value, "_modules", {}), getattr(value, "_parameters", {}), getattr(value, "_buffers", {})
        found = next((table[part] for table in children if table.get(part) is not None), None)
        if found is None:
            found = getattr(value, part, None)  # a plain tensor attribute (get_attr of a constant)
        if found is None:
            where = ".".join(target.split(".")[:depth]) or "the model"
            raise PlanError(f"node {node_id}: layer {target!r} not found: {where} ({type(value).__name__}) has no {part!r} "
                            f"(nor does the model hold it flat as {flat or layer_name(target)!r}); was the graph profiled from "
                            f"this model ({type(model).__name__})?")
        value = found
    return value


def stage_layers(graph: Graph, plan: Plan, stage_id: int) -> tuple[str, ...]:
    """Layer names (in topological order) held by one stage of a plan."""
    targets = layer_targets(graph)
    seen: list[str] = []
    for node_id in plan.stages[stage_id].node_ids:
        if node_id in targets and graph.attribute_names[targets[node_id]] not in seen:
            seen.append(graph.attribute_names[targets[node_id]])
    return tuple(seen)


def layer_owners(graph: Graph, plan: Plan) -> dict[str, tuple[int, ...]]:
    """Layer name -> ranks holding it under `plan` (all replicas of its stage)."""
    owners: dict[str, tuple[int, ...]] = {}
    for stage in plan.stages:
        for name in stage_layers(graph, plan, stage.stage_id):
            owners[name] = stage.ranks
    return owners


def check_plan_fits(plan: Plan, world_size: int) -> None:
    ranks = [r for s in plan.stages for r in s.ranks]
    if not all(s.ranks for s in plan.stages):
        raise PlanError("every stage of the plan needs ranks (call plan.with_default_ranks())")
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise PlanError(f"the plan places stages on rank(s) {bad} but the world has ranks 0..{world_size - 1}; "
                        f"start {max(ranks) + 1} workers or use a plan for {world_size}")
