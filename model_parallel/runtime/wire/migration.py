"""Switch a live pipeline to a new plan: move layers (parameters, buffers, optimizer state) between ranks.

Called by every rank at the same step boundary (the command rides in the step's one reduction,
wire/step_totals.py) with the same new plan; with a flush schedule nothing is in flight, so the switch is exact.

1. Who moves what: for every layer, its owners under the old plan (all replicas of its stage) and
   under the new one. Each new owner that did not hold the layer gets it from one old owner
   (the k-th new owner from old owner k mod n: replicas spread the sending). Every rank derives
   the same transfer list from the two plans; no negotiation.
2. One message per (source, destination) pair on `comm.TAG_MIGRATION`: a manifest (JSON) naming
   each value - `["state", "layer1_0_conv1.weight"]` for a parameter or buffer,
   `["opt", "layer1_0_conv1.weight", "momentum_buffer"]` for optimizer state - then the values
   (tensors, or JSON for scalars). Every rank first posts all its sends, then receives: no deadlock.
3. Received values are copied into this rank's layer objects (every rank holds every layer
   object; only owned ones are current; a layer on meta is first given storage). Kept layers
   are the same objects, untouched; `activate` puts layers that left back on meta (freed).
4. `engine.activate(new_plan, optimizer_state)` rebuilds the stage around those objects with
   `codegen.build_stage(..., modules=...)`, creates new replica groups collectively, and rebuilds
   the optimizer with its state keyed by parameter name (momentum, Adam moments, step counts).

Spares in either plan are handled the same way: a rank with no stage sends what it held and
receives nothing; a spare that becomes active receives all of its layers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any, Optional, Protocol, Union

import torch
from torch import nn

from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.build.materialize import allocate_layers
from model_parallel.runtime.build.stages import layer_owners
from model_parallel.runtime.build.tied import expand_state
from model_parallel.runtime.wire import comm

logger = logging.getLogger(__name__)

Transfer = tuple[int, int, str]  # (source rank, destination rank, layer name)


class MigratingEngine(Protocol):
    """What a plan switch needs of a rank's engine (`PipelineEngine` is one)."""

    graph: Graph
    plan: Plan  # the plan running now
    rank: int
    device: torch.device
    stage: Optional[nn.Module]  # this rank's stage under `plan`; None on a spare
    optimizer: Optional[torch.optim.Optimizer]

    @property
    def modules(self) -> MutableMapping[str, Union[nn.Module, torch.Tensor]]:
        """Every layer object by layer name, owned or not (a module, or a bare parameter/buffer tensor);
        a switch gives arriving meta layers storage in place."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds any blocking communication may take."""
        ...

    def activate(self, plan: Plan, optimizer_state: Optional[dict[str, dict[str, Any]]] = None) -> None:
        """Rebuild the stage and optimizer for `plan` around the layer objects (collective)."""
        ...


def plan_transfers(graph: Any, old: Plan, new: Plan) -> list[Transfer]:
    """Every (src, dst, layer) move needed to go from `old` to `new`, in a deterministic order."""
    before, after = layer_owners(graph, old), layer_owners(graph, new)
    moves: list[Transfer] = []
    for layer, new_ranks in after.items():
        old_ranks = before.get(layer, ())
        if not old_ranks:
            continue  # a layer nobody held (no state): nothing to move
        for index, dst in enumerate(new_ranks):
            if dst not in old_ranks:
                moves.append((old_ranks[index % len(old_ranks)], dst, layer))
    return moves


def _layer_keys(engine: MigratingEngine, layer: str) -> list[str]:
    obj = engine.modules[layer]
    if isinstance(obj, torch.Tensor):
        return [layer]
    return [f"{layer}.{key}" for key in obj.state_dict().keys()]


def _get_state(engine: MigratingEngine, key: str) -> torch.Tensor:
    layer, _, rest = key.partition(".")
    obj = engine.modules[layer]
    if isinstance(obj, torch.Tensor):  # a tensor layer's key is its name alone (see the listing above)
        return obj
    return obj.state_dict(keep_vars=True)[rest]


def switch_plan(engine: MigratingEngine, new_plan: Plan) -> float:
    """Move this rank's share of layers to `new_plan` and rebuild its stage; returns the pause in seconds."""
    from model_parallel.runtime.checkpoint.store import optimizer_state_by_name

    start = time.perf_counter()
    new_plan = new_plan.with_default_ranks()
    old_plan, rank, timeout = engine.plan, engine.rank, engine.timeout
    moves = plan_transfers(engine.graph, old_plan, new_plan)
    # Optimizer state of what this rank holds now, by parameter name (kept layers and outgoing ones).
    opt_state: dict[str, dict[str, Any]] = {}
    if engine.optimizer is not None and engine.stage is not None:
        opt_state = optimizer_state_by_name(engine.optimizer, dict(engine.stage.named_parameters()))
        # A tied Parameter is named once per stage: under every key of the tie, so it travels (and is
        # found again) under whichever key the sending and receiving stages hold it by.
        opt_state = expand_state(engine.graph, opt_state)

    outgoing: dict[int, list[str]] = {}
    incoming: dict[int, list[str]] = {}
    for src, dst, layer in moves:
        if src == rank:
            outgoing.setdefault(dst, []).append(layer)
        if dst == rank:
            incoming.setdefault(src, []).append(layer)

    handles = []
    sent_bytes = 0
    for dst in sorted(outgoing):
        manifest: list[list[str]] = []
        values: list[Any] = []
        for layer in outgoing[dst]:
            for key in _layer_keys(engine, layer):
                tensor = _get_state(engine, key).detach()
                manifest.append(["state", key])
                values.append(tensor)
                sent_bytes += tensor.numel() * tensor.element_size()
                for field, value in sorted(opt_state.get(key, {}).items()):
                    manifest.append(["opt", key, field])
                    values.append(value.detach() if isinstance(value, torch.Tensor) else value)
        handles.append(comm.send_values([manifest] + values, dst, comm.TAG_MIGRATION, device=engine.device))

    received_opt: dict[str, dict[str, Any]] = {}
    # Layers arriving on meta (a model built without memory) get storage here, their values below.
    allocate_layers(engine.modules, [layer for layers in incoming.values() for layer in layers], engine.device)
    for src in sorted(incoming):
        message = comm.recv_values(src, comm.TAG_MIGRATION, timeout, device=engine.device)
        manifest, values = message[0], message[1:]
        with torch.no_grad():
            for entry, value in zip(manifest, values):
                if entry[0] == "state":
                    _get_state(engine, entry[1]).copy_(value)
                else:
                    received_opt.setdefault(entry[1], {})[entry[2]] = value
    for handle in handles:
        handle.wait(timeout)

    # Kept parameters keep their state; arriving ones bring theirs.
    merged = {**opt_state, **received_opt}
    engine.activate(new_plan, optimizer_state=merged)
    pause = time.perf_counter() - start
    logger.info("rank %d: plan v%d -> v%d: sent %d layer(s) (%.1f MB), received %d layer(s), %.1f ms", rank,
                old_plan.version, new_plan.version, sum(len(v) for v in outgoing.values()), sent_bytes / 1e6,
                sum(len(v) for v in incoming.values()), pause * 1e3)
    return pause
