"""Profile a model larger than one device: `profile(..., layer_by_layer=True)`.

The whole-model profile needs every parameter in memory at once (PipeDream's profiler too). Here the
model is traced on meta (shapes only), then the graph is walked in topological order with real
activations of the profiled shape:

    node k:  materialize the tensors node k reads   (its module's, or the one a get_attr reads)
             time forward + backward in isolation    (the same replay as the whole-model profile)
             run it once for real                    (its output feeds the successors)
             put its tensors back on meta            (activations go after their last consumer)

so the peak is one node's parameters plus the live activations. A tensor's values come from the
model when it has real ones (copied: the model is never changed), else from the init rule
(`graph.init_rule`: the layer's `reset_parameters()` under a seed of (seed, layer name), the values
training starts from). A tensor no rule covers (a Hugging Face `Conv1D`, a bare tensor the export
route reads) gets a stand-in: normal(0, 0.02) for floating point, zeros otherwise; the timing of a
dense operator does not depend on the values as long as they are finite.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from model_parallel.errors import InitError, ProfileError
from model_parallel.graph.arguments import CONSTANTS, encode_constant
from model_parallel.graph.core import Graph
from model_parallel.graph import init_rule
from model_parallel.graph.init_rule import init_layer, layer_name
from model_parallel.profiler.export_trace import retarget_devices
from model_parallel.profiler.describe import describe
from model_parallel.profiler.trace import trace_model

logger = logging.getLogger(__name__)

SEED = 0  # the init rule's seed for meta tensors (training's default seed: the same values)
CPU = torch.device("cpu")


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of the model's parameters and buffers that have no storage."""
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


def refuse_meta(model: nn.Module) -> None:
    """The whole-model profile needs real values: say how to profile a model built on meta."""
    names = meta_tensors(model)
    if names:
        raise ProfileError(f"{type(model).__name__} has {len(names)} tensor(s) on meta (e.g. {names[0]!r}): it was "
                           "built under torch.device('meta'); profile it with layer_by_layer=True, which "
                           "materializes one node's parameters at a time")


def meta_copy(model: nn.Module) -> nn.Module:
    """The model with every parameter and buffer on meta (no storage allocated; ties stay ties)."""
    try:
        return init_rule.meta_copy(model)
    except Exception as error:  # deepcopy raises whatever a module's state raises
        raise ProfileError(f"layer_by_layer: could not copy {type(model).__name__} onto meta ({type(error).__name__}: "
                           f"{error}); build the model under torch.device('meta') and profile that") from error


def _stand_in(name: str, tensor: torch.Tensor) -> None:
    """Values for a tensor no init rule covers (drawn from the layer's seeded generator)."""
    if tensor.is_floating_point():
        tensor.normal_(0.0, 0.02)
    else:
        tensor.zero_()


class LayerWalk:
    """The state of one layer-by-layer profile: the meta model it traces, and the few real tensors.

    `materialized(node)` gives a call_module node's module real tensors for the duration of the
    node; `fetch(target)` gives a get_attr node a real copy of its tensor, freed with the node's
    other outputs after their last use. `live_bytes` / `peak_bytes` count the parameter and buffer
    bytes materialized at once (tensors are counted until they are garbage collected, not until
    they are handed back), which is what the tests check the walk's memory by.
    """

    def __init__(self, model: nn.Module, device: Optional[torch.device], example_inputs: Any = (),
                 seed: int = SEED) -> None:
        if any(t.is_meta for t in _tensors(example_inputs)):
            raise ProfileError("layer_by_layer: the example inputs are on meta; give real tensors (the walk runs "
                               "each node on real activations of the profiled shape)")
        real = [t for t in [*model.parameters(), *model.buffers()] if not t.is_meta]
        if device is None:
            device = real[0].device if real else CPU
        if device.type == "meta":
            raise ProfileError("layer_by_layer times real activations: give device='cpu', 'cuda' or 'auto', not meta")
        self.device = device
        self.seed = seed
        self.model_name = type(model).__name__
        # A model entirely on meta is walked in place (its tensors are swapped back after every node);
        # one with real values is walked on a meta copy, and its values are copied in node by node.
        self.model = model if not real else meta_copy(model)
        self.values = {n: t for n, t in [*model.named_parameters(remove_duplicate=False),
                                          *model.named_buffers(remove_duplicate=False)] if not t.is_meta}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.stand_ins: set[str] = set()
        self.gm: Optional[fx.GraphModule] = None
        self._names: dict[int, str] = {}

    # ---- tracing ---------------------------------------------------------------------------------
    def trace(self, args: tuple, kwargs: Mapping[str, Any], leaf_modules: Sequence[type[nn.Module]],
              route: str) -> tuple[Graph, fx.GraphModule]:
        """Trace the meta model on meta copies of the (real) example inputs."""
        to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
        graph, gm = trace_model(self.model, tree_map(to_meta, args), leaf_modules,
                                example_kwargs=tree_map(to_meta, dict(kwargs)), route=route)
        graph, gm = self._on_device(graph, gm)
        self.gm = gm
        for root in (self.model, gm):  # the names the model knows a tensor by (export may hold its own objects)
            for name, tensor in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
                self._names.setdefault(id(tensor), name)
        constants = dict(graph.metadata.get(CONSTANTS) or {})
        for target in constants:  # traced on meta: the real model's values, where it has them
            if target in self.values:
                constants[target] = encode_constant(self.values[target])
        if constants:
            graph = replace(graph, metadata={**graph.metadata, CONSTANTS: constants})
        return graph, gm

    def _on_device(self, graph: Graph, gm: fx.GraphModule) -> tuple[Graph, fx.GraphModule]:
        """torch.export bakes the device it traced on into operators (GPT-2's `.to(inputs_embeds.device)`
        becomes `aten.to(..., device=meta)`); the graph records it as the run device already
        (`export_trace.portable_devices`), the module to time gets the profiling device, as a real trace has it."""
        changed = {n.name: describe(n, None, 0) for n in retarget_devices(gm, torch.device("meta"), self.device)}
        nodes = tuple(replace(node, description=changed[node.node_id]) if node.node_id in changed else node
                      for node in graph.nodes)
        return replace(graph, nodes=nodes), gm

    # ---- materializing -----------------------------------------------------------------------------
    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(tensor, self._freed, size)
        return tensor

    def _freed(self, size: int) -> None:
        self.live_bytes -= size

    def _initial(self, name: str, layer: Any, tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Initial values (on the CPU, by id of the meta tensor) for one layer's tensors by the init rule."""
        # Zeros, not torch.empty: a buffer the rule does not reset must not time on NaNs or denormals.
        cpu = {id(t): torch.zeros_like(t, device=CPU) for t in tensors}
        if isinstance(layer, torch.Tensor):
            self.stand_ins.add(name)
            init_layer(name, cpu[id(layer)], self.seed, bare_tensor=_stand_in)
            return cpu
        swapped = _swap(layer, lambda t: cpu.get(id(t)))
        try:
            init_layer(name, layer, self.seed)
        except InitError:  # a module without reset_parameters(): stand-ins under the same seed
            self.stand_ins.add(name)
            init_layer(name, layer, self.seed, init_weights=lambda obj, n: [_stand_in(n, t) for t in _own(obj)])
        finally:
            _restore(swapped)
        return cpu

    def _fill(self, name: str, layer: Any, tensors: Sequence[torch.Tensor], paths: Sequence[str]) -> list[torch.Tensor]:
        """Real tensors on the profiling device for `tensors` (one layer's meta tensors): the model's
        values where it has them, else the init rule's."""
        keys = [self._names.get(id(t), p) for t, p in zip(tensors, paths)]
        initial = self._initial(name, layer, tensors) if any(k not in self.values for k in keys) else {}
        out = []
        for tensor, key in zip(tensors, keys):
            value = self.values[key] if key in self.values else initial[id(tensor)]
            moved = value.detach().to(self.device, copy=True)  # a copy: the replay must not touch the model's buffers
            out.append(self._count(nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved))
        return out

    @contextmanager
    def materialized(self, node: fx.Node) -> Iterator[None]:
        """A call_module node's module with real tensors while the node is timed and run."""
        if node.op != "call_module":
            yield
            return
        with self.materialized_module(str(node.target)):
            yield

    def tensor_bytes(self, node: fx.Node) -> int:
        """The bytes materializing what `node` reads costs (as `live_bytes` counts them): a call_module's
        module tensors (each once), a get_attr's meta tensor; 0 for other nodes."""
        if node.op == "call_module":
            tensors = {id(t): t for _, _, t in _entries(self.gm.get_submodule(str(node.target)))}.values()  # type: ignore[union-attr]
        elif node.op == "get_attr":
            value: Any = self.gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            tensors = [value] if isinstance(value, torch.Tensor) and value.is_meta else []  # (as `fetch` counts)
        else:
            return 0
        return sum(t.numel() * t.element_size() for t in tensors)

    @contextmanager
    def materialized_module(self, target: str) -> Iterator[nn.Module]:
        """The module at `target` with real tensors inside the block (meta ones again after it)."""
        module = self.gm.get_submodule(target)  # type: ignore[union-attr]
        tensors, paths = [], []
        for path, key, tensor in _entries(module):
            if id(tensor) not in {id(t) for t in tensors}:
                tensors.append(tensor)
                paths.append(f"{target}.{path}{key}")
        real = dict(zip(map(id, tensors), self._fill(layer_name(target), module, tensors, paths)))
        swapped = _swap(module, lambda t: real.get(id(t)))
        del real
        try:
            yield module
        finally:
            _restore(swapped)  # the real tensors are dropped here (and the replay's graphs are gone)

    def fetch(self, target: str) -> Any:
        """What a get_attr (or call_module's lookup) of `target` sees: a real copy of a tensor."""
        value: Any = self.gm
        for part in target.split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            return value
        if not value.is_meta:  # a constant export lifted (created in forward): it has its values
            return value.to(self.device)
        return self._fill(layer_name(target), value, [value], [target])[0]

    def interpreter(self, base: type[fx.Interpreter]) -> type[fx.Interpreter]:
        """`base` (the profiler's timing interpreter) running each node with its tensors materialized."""
        walk = self

        class LayerByLayerInterpreter(base):  # type: ignore[valid-type, misc]
            def run_node(self, n: fx.Node) -> Any:
                with walk.materialized(n):
                    return super().run_node(n)

            def fetch_attr(self, target: str) -> Any:
                return walk.fetch(target)

        return LayerByLayerInterpreter

    @contextmanager
    def preserved(self) -> Iterator[None]:
        """Training mode while profiling (modes put back after) and the RNG untouched; the caller's
        model is never moved or changed."""
        modes = [(m, m.training) for m in self.model.modules()]
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            try:
                self.model.train()
                yield
            finally:
                for module, training in modes:
                    module.training = training

    def summary(self) -> dict[str, Any]:
        """What the walk held at most, for `graph.metadata["profile"]["layer_by_layer"]`."""
        return {"peak_parameter_bytes": self.peak_bytes, "seed": self.seed,
                "stand_in_layers": sorted(self.stand_ins), "values_from_model": bool(self.values)}


# ---- module tables -----------------------------------------------------------------------------------
def _entries(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(submodule path with a trailing dot, key, tensor) for every tensor the module holds."""
    for path, sub in module.named_modules(remove_duplicate=False):
        for table in (sub._parameters, sub._buffers):
            for key, tensor in table.items():
                if tensor is not None:
                    yield (f"{path}." if path else ""), key, tensor


def _swap(module: nn.Module, convert: Any) -> list[tuple[dict, str, torch.Tensor]]:
    """Put `convert(tensor)` (when not None) in place of each tensor; returns what to put back."""
    swapped = []
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, tensor in list(table.items()):
                new = convert(tensor) if tensor is not None else None
                if new is not None:
                    swapped.append((table, key, tensor))
                    table[key] = new
    return swapped


def _restore(swapped: list[tuple[dict, str, torch.Tensor]]) -> None:
    for table, key, tensor in reversed(swapped):
        table[key] = tensor


def _own(obj: Any) -> list[torch.Tensor]:
    return [obj] if isinstance(obj, torch.Tensor) else [t for _, _, t in _entries(obj)]


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda v: found.append(v) if isinstance(v, torch.Tensor) else None, value)
    return found
