"""Models built without memory: each rank gives real values to the layers of its own stage only.

    with torch.device("meta"):                       # shapes and dtypes, no storage
        model = MyModel(cfg)
    PipelineTrainer(model, ...)                      # rank k allocates and initialises stage k's layers

A layer (a call_module target or a get_attr tensor, named by `codegen.naming.layer_name`) gets its
values from, in this order:

1. a `ValueSource` (our layer-keyed checkpoint, safetensors files: `runtime/build/weights.py`), by stage
   state-dict key (`blocks_0_fc.weight`), reading only the keys of the layers being built;
2. otherwise the init rule: under a CPU generator seeded with `layer_seed(seed, layer_name)`, the
   user's `init_weights(layer, layer_name)` hook if given; else, for a Hugging Face `PreTrainedModel`,
   the model's own `_init_weights` (`hf_init_weights(model)`, graph/init_rule.py: what `from_config`
   applies); else `reset_parameters()` of every module of the layer that holds tensors directly; a
   bare tensor (the torch.export route lifts parameters out of their modules) gets what its owning
   module's `reset_parameters()` gives it. A tensor nothing can initialise is a loud error naming it.

Every layer draws from its own seed, so its values do not depend on the partition, on which rank
builds it, or on the order; `materialize_model` applies the same rule to a whole model, which is how
the single-process reference agrees with the pipeline. A tied tensor takes the values its owner
layer (the tie's first user) gives it, wherever that layer lives. Only meta tensors are touched: a
model built with real values keeps them (and its memory, until the caller drops it).
"""
from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import fx, nn

from model_parallel.codegen.naming import find_ties, layer_name
from model_parallel.errors import InitError
from model_parallel.graph import init_rule as rule
from model_parallel.graph.core import Graph
from model_parallel.graph.init_rule import InitWeights, Layer, TensorOwners, layer_seed, owner_reset, tensor_owners
from model_parallel.graph.sizes import check_fits

logger = logging.getLogger(__name__)

__all__ = ["InitError", "Initializer", "ValueSource", "layer_seed", "materialize_layers", "materialize_model"]


class ValueSource(Protocol):
    """Stored values by stage state-dict key (`layer_name.param`, or `layer_name` for a bare tensor)."""

    def read(self, expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The values of these keys (checked against the expected tensors' shapes and dtypes); may
        leave out keys it does not hold only when `partial` is set, else raise naming the key."""
        ...


@dataclass(frozen=True)
class Initializer:
    """Where a layer's first values come from (see the module docstring)."""

    seed: int = 0
    init_weights: Optional[InitWeights] = None
    source: Optional[ValueSource] = None
    # A model rebuilt from a graph file: a bare tensor there is a weight an ATen graph reads directly
    # (torch.export route), which no module initialises; it gets the generator's defaults by name
    # (codegen.layers.fresh_tensor) under its own seed. A user's own module's bare tensor is refused instead.
    bare_tensor_defaults: bool = False
    # The model the layers come from: a bare tensor's owning module is looked up there (owner_reset).
    model: Optional[nn.Module] = None

    @functools.cached_property
    def owners(self) -> Optional[TensorOwners]:
        return tensor_owners(self.model) if self.model is not None and not self.bare_tensor_defaults else None

    @functools.cached_property
    def hook(self) -> Optional[InitWeights]:
        """The hook the init rule applies: `init_weights` if given, else a Hugging Face model's own
        `_init_weights` (many HF modules have no reset_parameters(), and it is what `from_config` gives)."""
        if self.init_weights is not None or self.model is None or self.bare_tensor_defaults:
            return self.init_weights

        return rule.hf_init_weights(self.model) if rule.is_hugging_face_model(self.model) else None


def _tensors(obj: Layer) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [*obj.parameters(), *obj.buffers()]


def is_meta(obj: Layer) -> bool:
    """Whether any tensor of the layer has no storage yet."""
    return any(t.is_meta for t in _tensors(obj))


def layer_state(name: str, obj: Layer) -> dict[str, torch.Tensor]:
    """The layer's persistent state by stage state-dict key (what checkpoints and sources hold)."""
    if isinstance(obj, torch.Tensor):
        return {name: obj}
    return {f"{name}.{key}": value for key, value in obj.state_dict(keep_vars=True).items()}


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Fresh storage of the same shape and dtype; a Parameter stays a Parameter (so it trains when it returns)."""
    new = torch.empty_like(tensor.detach(), device=device)
    return nn.Parameter(new, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new


def _replace(obj: Layer, convert: Callable[[torch.Tensor], Optional[torch.Tensor]],
             memo: Optional[dict[int, torch.Tensor]] = None) -> Layer:
    """Swap every tensor of a layer for `convert(tensor)` (None: keep it); the layer object stays (a
    bare tensor is returned anew). One tensor held twice (within `memo`'s calls) is converted once, so
    ties stay ties."""
    memo = {} if memo is None else memo

    def swap(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in memo:
            new = convert(tensor)
            memo[id(tensor)] = tensor if new is None else new
        return memo[id(tensor)]

    if isinstance(obj, torch.Tensor):
        return swap(obj)
    for module in obj.modules():
        for table in rule.tensor_tables(module):
            for key, tensor in table.items():
                if tensor is not None:
                    table[key] = swap(tensor)
    return obj


def check_layer_sizes(modules: Mapping[str, Layer], names: Sequence[str]) -> None:
    """The meta tensors of these layers fit this host's memory together: refused (InitError naming the
    largest layer) before any is allocated, instead of the kernel killing the process while it fills them."""
    need = {n: sum(t.numel() * t.element_size() for t in {id(t): t for t in _tensors(modules[n]) if t.is_meta}.values())
            for n in names}
    if need:
        largest = max(need, key=need.__getitem__)
        where = f"layers {', '.join(list(need)[:3])}{' ...' if len(need) > 3 else ''}"
        what = f"allocating {len(need)} layer(s) (the largest, {largest}, {need[largest] / (1 << 30):,.1f} GiB)"
        check_fits(sum(need.values()), where, what, InitError)
        _check_process_limit(sum(need.values()), where, what)


def _check_process_limit(num_bytes: int, where: str, what: str) -> None:
    """The same against this process's RLIMIT_AS / RLIMIT_DATA less what it holds (a worker capped below the host's
    memory): refused in one line with the fix, where the allocator would fail mid-build with a raw RuntimeError."""
    from model_parallel.runtime.observe.memory_probe import memory_limit, status_bytes

    limit, name = memory_limit(torch.device("cpu"))
    if limit is None:
        return
    try:  # the rlimit counts what the process maps already (RLIMIT_AS: its address space; RLIMIT_DATA: its data)
        used = status_bytes("VmSize" if name == "RLIMIT_AS" else "VmData")
    except (OSError, KeyError, ValueError):
        return
    if num_bytes > limit - used:
        gib = 1 << 30
        raise InitError(f"{where}: {what} needs {num_bytes / gib:,.1f} GiB, more than this process may still take "
                        f"({max(0, limit - used) / gib:,.1f} GiB of its {name} {limit / gib:,.1f} GiB); give the job "
                        "memory_per_worker (--memory_per_worker) at the limit to get a plan that fits, or raise the limit")


def allocate_layers(modules: MutableMapping[str, Layer], names: Iterable[str], device: torch.device) -> list[str]:
    """Give the meta tensors of these layers uninitialised storage on `device` (values still to come:
    received, loaded or initialised). Returns the layers that had meta tensors."""
    done: list[str] = []
    memo: dict[int, torch.Tensor] = {}
    for name in names:
        if is_meta(modules[name]):
            modules[name] = _replace(modules[name], lambda t: _empty_like(t, device) if t.is_meta else None, memo)
            done.append(name)
    return done


def release_layers(modules: MutableMapping[str, Layer], names: Iterable[str]) -> None:
    """Put these layers back on meta: their storage is freed once nothing else refers to it (the old
    stage module and optimizer are dropped by then)."""
    memo: dict[int, torch.Tensor] = {}
    for name in names:
        modules[name] = _replace(modules[name], lambda t: None if t.is_meta else _empty_like(t, torch.device("meta")),
                                 memo)


def move_real(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to(device)` for the tensors that have storage; meta ones stay on meta."""
    for module in model.modules():
        for table in rule.tensor_tables(module):
            for key, tensor in table.items():
                if tensor is not None and not tensor.is_meta and tensor.device != device:
                    moved = tensor.detach().to(device)
                    table[key] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
    return model


# ---- the init rule (owned by graph/init_rule.py: the profiler applies it too) ------------------------
def init_layer(name: str, obj: Layer, seed: int, init_weights: Optional[InitWeights] = None,
               bare_tensor_defaults: bool = False, owners: Optional[TensorOwners] = None) -> None:
    """Initialise one (allocated) layer under its own seed; refuse a tensor no rule covers. A bare
    tensor: the generator's defaults by name (a model rebuilt from a graph file), else its owner's
    reset_parameters() (`owners`: of the model the layers come from)."""
    bare = _fresh_defaults if bare_tensor_defaults else owner_reset(owners) if owners is not None else None
    rule.init_layer(name, obj, seed, init_weights, bare)


def _fresh_defaults(name: str, tensor: torch.Tensor) -> None:
    from model_parallel.codegen.layers import fresh_tensor

    tensor.copy_(fresh_tensor(name, tuple(tensor.shape), tensor.dtype))


def _tie_owners(graph: Optional[Graph], modules: Mapping[str, Layer]) -> dict[int, str]:
    """id(tensor) -> the layer whose init gives a tied tensor its values (the tie's first user)."""
    owners: dict[int, str] = {}
    if graph is not None:
        for tie in find_ties(graph):
            first = graph[tie.users[0][0]].layer
            owner = graph.attribute_names.get(first.target) if first is not None else None
            if owner is not None and owner in modules:
                for node_id, _ in tie.users:
                    layer = graph[node_id].layer
                    other = modules.get(graph.attribute_names.get(layer.target, "")) if layer is not None else None
                    for tensor in _tensors(other) if other is not None else []:
                        owners.setdefault(id(tensor), owner)
    seen: dict[int, str] = {}
    for name, obj in modules.items():  # without a graph: the first layer holding it, in layer order
        for tensor in _tensors(obj):
            seen.setdefault(id(tensor), name)
    shared = {k for k in seen if sum(any(id(t) == k for t in _tensors(o)) for o in modules.values()) > 1}
    return {k: owners.get(k, seen[k]) for k in shared}


def _owner_values(owner: str, obj: Layer, init: Initializer) -> dict[int, torch.Tensor]:
    """The values the owner layer's init gives its tensors, from a throwaway copy (the owner lives on
    another rank; its rule is deterministic), by id of the original (meta) tensor."""
    memo: dict[int, Any] = {}
    clone = _replace(copy.deepcopy(obj, memo), lambda t: _empty_like(t, torch.device("cpu")) if t.is_meta else None)
    init_layer(owner, clone, init.seed, init.hook, init.bare_tensor_defaults, init.owners)
    # Matched by position after the swap: a meta owner's clone holds new tensors, which no id of the clone's
    # own meta tensors names (a tied GPT-2 head on meta, its embedding on another rank, was a KeyError).
    return {id(o): c.detach() for o, c in zip(_tensors(obj), _tensors(clone))}


def materialize_layers(
    modules: MutableMapping[str, Layer],
    names: Sequence[str],
    init: Initializer,
    device: torch.device = torch.device("cpu"),
    graph: Optional[Graph] = None,
    constants: Optional[Mapping[str, Optional[torch.Tensor]]] = None,
) -> list[str]:
    """Allocate and fill the meta layers among `names` (see the module docstring); returns them.

    `constants`: layer name -> value of a non-persistent buffer recorded in the graph (no state dict
    has it; None: the graph holds no values, e.g. traced on meta, and the init rule must give them). Layers are filled on the CPU (the CPU generator gives the same values on
    every machine) and then moved to `device`.
    """
    tied = _tie_owners(graph, modules)
    pending = [n for n in names if is_meta(modules[n])]
    before = {n: list(_tensors(modules[n])) for n in pending}  # the meta tensors, for tie lookups
    # Tie owners last: a user's reset_parameters must not have the last word on a tensor it shares.
    order = sorted(pending, key=lambda n: any(tied.get(id(t)) == n for t in before[n]))
    cpu = torch.device("cpu")
    check_layer_sizes(modules, pending)
    allocated = allocate_layers(modules, pending, cpu)
    stored: dict[str, torch.Tensor] = {}
    if init.source is not None and allocated:
        expected = {k: v for n in allocated if n not in (constants or {}) for k, v in layer_state(n, modules[n]).items()}
        stored = init.source.read(expected)
    for name in order:
        obj = modules[name]
        keys = layer_state(name, obj)
        constant = constants.get(name) if constants is not None else None
        if constant is not None:
            if not isinstance(obj, torch.Tensor):
                raise InitError(f"constant {name!r} (a non-persistent buffer in the graph) is a {type(obj).__name__} "
                                f"in the model, not a tensor; is the graph from this model?")
            with torch.no_grad():
                obj.copy_(constant)
            continue
        if constants is not None and name in constants and init.hook is None and init.owners is None:
            raise InitError(f"constant {name!r} (a non-persistent buffer) was built on meta and the graph holds no "
                            f"values for it (too large, or traced on meta); build that buffer with real values")
        complete = bool(keys) and all(k in stored for k in keys) and len(_tensors(obj)) == len(keys)
        if not complete:
            init_layer(name, obj, init.seed, init.hook, init.bare_tensor_defaults, init.owners)
        with torch.no_grad():
            for key, tensor in keys.items():
                if key in stored:
                    tensor.copy_(stored[key])
    # Tied tensors whose owner is elsewhere: the owner's values, from a throwaway copy of the owner.
    for name in pending:
        for meta, real in zip(before[name], _tensors(modules[name])):
            owner = tied.get(id(meta))
            if owner is not None and owner not in pending and init.source is None:
                with torch.no_grad():
                    real.copy_(_owner_values(owner, modules[owner], init)[id(meta)])
    if device != cpu:
        memo: dict[int, torch.Tensor] = {}
        for name in pending:
            modules[name] = _replace(modules[name], lambda t: _moved(t, device), memo)
    if pending:
        logger.debug("materialized %d layer(s) on %s: %s", len(pending), device, ", ".join(pending[:8]))
    return pending


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    moved = tensor.detach().to(device)
    return nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved


def graph_constants(graph: Graph, modules: Mapping[str, Layer]) -> dict[str, Optional[torch.Tensor]]:
    """Layer name -> the recorded value of each constant (non-persistent buffer) the graph reads and the
    model holds on meta; None where the graph holds no values (materialize_layers applies the init rule)."""
    from model_parallel.graph.arguments import CONSTANTS, decode_constant

    records = graph.metadata.get(CONSTANTS) or {}
    out: dict[str, Optional[torch.Tensor]] = {}
    for target, record in records.items():
        name = graph.attribute_names.get(target, layer_name(target))
        if name in modules and is_meta(modules[name]):
            out[name] = decode_constant(record, f"graph constant {target!r}")
    return out


# ---- whole models (the single-process reference) -----------------------------------------------------
def default_layers(model: nn.Module) -> dict[str, Layer]:
    """Layers as torch.fx's default tracer sees them (what the profiler's graph holds for a plain model):
    every leaf module (torch.nn's own, not containers), and every tensor held directly by another module."""
    tracer = fx.Tracer()
    out: dict[str, Layer] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        if prefix and tracer.is_leaf_module(module, prefix):
            out[layer_name(prefix)] = module
            return
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                out[layer_name(f"{prefix}.{key}" if prefix else key)] = tensor
        for key, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}.{key}" if prefix else key)

    visit(model, "")
    return out


def materialize_model(
    model: nn.Module,
    seed: int = 0,
    graph: Optional[Graph] = None,
    *,
    init_weights: Optional[InitWeights] = None,
    source: Optional[ValueSource] = None,
    device: torch.device = torch.device("cpu"),
) -> nn.Module:
    """Give every meta tensor of `model` the values the pipeline gives it (same rule, same seeds, the
    same default hook for a Hugging Face model), in place; layers from `graph` when given, else
    `default_layers(model)`. Returns the model."""
    from model_parallel.runtime.build.stages import layer_modules

    layers = dict(layer_modules(graph, model) if graph is not None else default_layers(model))
    paths = {layer_name(t): t for t in _tensor_paths(model)}
    # Tensors the graph does not read (Llama's `original_inv_freq`): the rule too, as bare tensors by path.
    covered = {id(t) for obj in layers.values() for t in _tensors(obj)}
    unread = {layer_name(path): tensor for path, tensor in [*model.named_parameters(), *model.named_buffers()]
              if tensor.is_meta and id(tensor) not in covered and layer_name(path) not in layers}
    layers.update(unread)
    before = dict(layers)
    constants = {**(graph_constants(graph, layers) if graph is not None else {}), **dict.fromkeys(unread)} or None
    init = Initializer(seed, init_weights, source, model=model)
    materialize_layers(layers, list(layers), init, device, graph, constants)
    for name, obj in layers.items():
        if isinstance(obj, torch.Tensor) and obj is not before[name]:
            _set_tensor(model, paths.get(name, name), obj)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise InitError(f"{type(model).__name__}: {len(left)} tensor(s) belong to no layer and stayed on meta, "
                        f"e.g. {left[:3]}; are they used by the model's forward?")
    return model


def _tensor_paths(model: nn.Module) -> list[str]:
    return [n for n, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]]


def _set_tensor(model: nn.Module, path: str, tensor: torch.Tensor) -> None:
    owner_path, _, key = path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    rule.tensor_table(owner, key)[key] = tensor
