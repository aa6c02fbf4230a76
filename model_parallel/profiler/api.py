"""`model_parallel.profile(model, example_inputs, loss_fn)`: the operator graph of a model with per-node times."""
from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator, Optional, Protocol, Union

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map
from tqdm.auto import tqdm

from model_parallel.errors import ProfileError
from model_parallel.graph.core import Graph, TensorMeta
from model_parallel.profiler.insitu import Instrumentation, calibrate_instrumentation, run_steps
from model_parallel.profiler.layer_by_layer import LayerWalk, refuse_meta
from model_parallel.profiler.saved import NodeByNodeSaving, record_saved_bytes, record_saved_bytes_by_node
from model_parallel.profiler.timing import (HarnessOverhead, NodeTiming, Replay, ReplayInterpreter, calibrate_overhead,
                                            check_clock, float32_output, precision_autocast)
from model_parallel.profiler.segments import run_segments
from model_parallel.graph.arguments import OutputDict
from model_parallel.graph.precision import PRECISIONS
from model_parallel.profiler.trace import flat_inputs, run_preserving_state, split_inputs, tensor_metas, trace_model

logger = logging.getLogger(__name__)

DeviceLike = Union[str, torch.device, None]


class TimingStore(Protocol):
    """Where per-node timings are kept as they are measured, so an interrupted profile resumes
    (`model_parallel.profiler.resume.PartialProfile` keeps them in a file)."""

    def begin(self, graph: Graph) -> Mapping[str, NodeTiming]:
        """The timings already measured for this traced graph (their nodes are not replayed again)."""

    def record(self, node_id: str, timing: NodeTiming) -> None:
        """One more node timed."""


def resolve_device(device: DeviceLike, model: Optional[nn.Module] = None) -> torch.device:
    """`None` = where the model's parameters are (cpu for a parameterless model); "auto" = cuda if present."""
    if device is None:
        for tensor in list(model.parameters()) + list(model.buffers()) if model is not None else []:
            return tensor.device
        return torch.device("cpu")
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(f"device {device!r} was asked for but CUDA is not available here; use --device cpu or auto")
    return resolved


def to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor in a nested value to `device`."""
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


@functools.lru_cache(maxsize=None)
def harness_overhead(device: torch.device, clock: str = "wall") -> HarnessOverhead:
    """The replay's per-call cost on `device`, measured once per process (about 0.2 s)."""
    overhead = calibrate_overhead(device, clock=clock)
    logger.info("replay overhead per node on %s: forward %.4f ms, backward %.4f ms", device, overhead.forward_ms, overhead.backward_ms)
    return overhead


@functools.lru_cache(maxsize=None)
def instrumentation_cost(clock: str = "wall") -> Instrumentation:
    """The in-situ instrumentation's per-window and per-hook cost, measured once per process (about 0.1 s)."""
    cost = calibrate_instrumentation(clock)
    logger.info("in-situ instrumentation (%s clock): forward window %.4f ms, backward hook %.4f ms", clock, cost.forward_ms, cost.backward_ms)
    return cost


TIMINGS = ("auto", "insitu", "replay")


def timing_mode(timing: str, device: torch.device, resumable: bool = False) -> str:
    """"auto": in situ on CPU, isolated replay on other devices (in-situ timing is CPU-only, see
    profiler.insitu) and where a `store` resumes node by node (`resumable`: in-situ steps time every
    node at once, so an interrupted in-situ profile resumes only once all nodes were timed)."""
    if timing not in TIMINGS:
        raise ProfileError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    if timing == "insitu" and device.type != "cpu":
        raise ProfileError(f"timing='insitu' runs on CPU only (got device {device}); use timing='replay' or 'auto'")
    if timing == "auto":
        return "insitu" if device.type == "cpu" and not resumable else "replay"
    return timing


def _time_in_situ(gm: fx.GraphModule, graph: Graph, inputs: Sequence[Any], loss_fn: Optional[Callable[[Any], torch.Tensor]],
                  warmup: int, iterations: int, clock: str, cost: Instrumentation, known: Mapping[str, NodeTiming],
                  store: Optional[TimingStore], bar: tqdm, precision: str = "fp32") -> tuple[dict[str, NodeTiming], NodeTiming, Optional[float]]:
    """Node timings from real training steps of `gm` (see profiler.insitu); the loss's; the instrumented step ms."""
    timed = {n.node_id for n in graph.nodes
             if n.layer.op in ("call_function", "call_method", "call_module") and n.layer.outputs}
    if timed and timed <= set(known):  # an interrupted run timed them all: nothing left to measure
        return {k: v for k, v in known.items() if k in timed}, NodeTiming(0.0, 0.0), None
    wrap = output_dicts if precision == "fp32" else lambda out: float32_output(output_dicts(out))
    result = run_steps(gm, inputs, loss_fn, timed, warmup=warmup, iterations=iterations, clock=clock,
                       instrumentation=cost, wrap_output=wrap, on_step=lambda: bar.update(1),
                       autocast=lambda: precision_autocast(precision, torch.device("cpu")))
    if store is not None:
        for node_id, node_timing in result.timings.items():
            store.record(node_id, node_timing)
    return result.timings, result.loss, result.step_ms


def _time_segments(walk: LayerWalk, gm: fx.GraphModule, graph: Graph, inputs: Sequence[Any],
                   loss_fn: Optional[Callable[[Any], torch.Tensor]], warmup: int, iterations: int, clock: str,
                   cost: Instrumentation, known: Mapping[str, NodeTiming], store: Optional[TimingStore], bar: tqdm,
                   budget: Optional[int], precision: str = "fp32") -> tuple[dict[str, NodeTiming], NodeTiming, float, dict[str, Any]]:
    """`_time_in_situ` for a layer-by-layer walk: segment by segment (see profiler.segments)."""
    timed = {n.node_id for n in graph.nodes
             if n.layer.op in ("call_function", "call_method", "call_module") and n.layer.outputs}
    result = run_segments(walk, gm, inputs, loss_fn, timed, budget=budget, warmup=warmup, iterations=iterations,
                          clock=clock, instrumentation=cost, known=known,
                          wrap_output=output_dicts if precision == "fp32" else lambda out: float32_output(output_dicts(out)),
                          record=store.record if store is not None else None, on_step=lambda: bar.update(1),
                          autocast=lambda: precision_autocast(precision, torch.device("cpu")))
    summary = {"budget_bytes": result.budget_bytes, "segments": result.segments, "boundary_ms": result.boundary_ms}
    return result.timings, result.loss, result.step_ms, summary


@contextmanager
def preserved_model(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Everything profiling may touch is put back: buffers (BatchNorm statistics), train/eval mode,
    the RNG (dropout draws), and the device the model lives on."""
    original_device = resolve_device(None, model)
    modes = [(module, module.training) for module in model.modules()]  # per module: mixed modes survive
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        saved_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        try:
            if original_device != device:
                model.to(device)
            model.train()  # profile what training runs: batch statistics, dropout, auxiliary heads
            yield
        finally:
            for module, training in modes:
                module.training = training
            if original_device != device:
                model.to(original_device)
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    if name in saved_buffers:
                        buffer.copy_(saved_buffers[name].to(buffer.device))


class _DtypeRecorder(fx.Interpreter):
    """Runs the traced model once, keeping each node's output shapes and dtypes."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.metas: dict[str, tuple[TensorMeta, ...]] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.metas[n.name] = tensor_metas(result)
        return result


def _dtypes_at(graph: Graph, gm: fx.GraphModule, inputs: Sequence[Any], precision: str, device: torch.device,
               walk: Optional[LayerWalk]) -> Graph:
    """`graph` with each node's output dtypes and `activation_size` as a forward at `precision` produces
    them (bf16: autocast makes a Linear's output bf16, 2 bytes per element; a LayerNorm's stays float32):
    the bytes a stage holds. (The trace ran without autocast; what crosses is `graph.precision.wire_bytes`.)"""
    recorder = (walk.interpreter(_DtypeRecorder) if walk is not None else _DtypeRecorder)(gm)
    with torch.no_grad(), precision_autocast(precision, device):
        run_preserving_state(gm, lambda: recorder.run(*inputs))
    nodes = []
    for node in graph.nodes:
        metas = recorder.metas.get(node.node_id)
        if metas is None or node.layer is None or len(metas) != len(node.layer.outputs):
            nodes.append(node)
            continue
        sizes = tuple(float(m.numel * getattr(torch, m.dtype).itemsize) for m in metas)
        nodes.append(replace(node, layer=replace(node.layer, outputs=metas),
                             activation_size=sizes if len(sizes) > 1 else (sizes[0] if sizes else 0.0)))
    return replace(graph, nodes=tuple(nodes))


def output_dicts(value: Any) -> Any:
    """A traced model's output with every dict an `OutputDict` (`out.logits` works, as on a ModelOutput)."""
    if isinstance(value, Mapping):
        return OutputDict((k, output_dicts(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value)(output_dicts(v) for v in value) if type(value) in (tuple, list) else value
    return value


def profile(
    model: nn.Module,
    example_inputs: Union[Iterable[Any], Mapping[str, Any]],
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    *,
    example_kwargs: Optional[Mapping[str, Any]] = None,
    route: str = "auto",
    warmup: int = 1,
    iterations: int = 3,
    device: DeviceLike = None,
    leaf_modules: Sequence[type[nn.Module]] = (),
    subtract_overhead: bool = True,
    progress: bool = False,
    clock: str = "wall",
    store: Optional[TimingStore] = None,
    timing: str = "auto",
    layer_by_layer: bool = False,
    precision: str = "fp32",
    layer_by_layer_bytes: Optional[int] = None,
) -> Graph:
    """Profile `model` on `example_inputs` (one minibatch) and return its operator graph with times.

    `example_inputs` is a tuple of positional inputs or a dict of keyword inputs (`{"input_ids": ...,
    "attention_mask": ...}`); `example_kwargs` adds keyword inputs to positional ones. `route` picks
    the tracer ("auto", "fx", "export"; see `trace_model` and docs/profiler.md): unmodified Hugging
    Face and timm models need no wrapper. A dict output (a ModelOutput) reaches `loss_fn` as an
    `OutputDict`, so `out.logits` works.

    One node per torch.fx node; each node's `forward_ms` / `backward_ms` at this batch size is, with
    `timing="insitu"` (the default on CPU without a `store`), its median over `iterations` real training steps of the
    traced model (after `warmup` untimed ones), timed in place (`profiler.insitu`); with
    `timing="replay"` (the default elsewhere) the median of `iterations` isolated replays of the node.
    `subtract_overhead` subtracts the measured cost of the instrumentation (in-situ) or of the
    replay harness (replay). `loss_fn(output) -> scalar` is timed too, into
    `graph.metadata["profile"]["loss_forward_ms" / "loss_backward_ms"]` (it is not a graph node).
    `device`: None = where the model is; "auto" = cuda if available; else a torch device (the model is
    moved there for profiling and back afterwards). The model is left exactly as it was: parameters,
    gradients, buffers (BatchNorm statistics), train/eval mode and the RNG state.
    `clock`: "wall" (default) or "cpu" (this process's CPU time; CPU only): on a machine shared with
    other busy processes, time they take from this one is then not counted.
    `store`: keeps each node's timing as it is measured and supplies the ones an interrupted run
    already measured (those nodes are not replayed); see `TimingStore`.
    `layer_by_layer`: for a model larger than one device, or built under `torch.device("meta")`: traced
    on meta and timed with only some tensors materialized; the model is never moved. In situ (CPU):
    segment by segment, each segment's tensors at most `layer_by_layer_bytes` (default 1/8 of the
    model's, never below its largest node; `profiler.segments`); replay: one node at a time
    (`profiler.layer_by_layer`). `device` None is then where the model's real tensors are, else the CPU.
    `precision`: "fp32" (default) or "bf16": time every forward under the bf16 autocast the runtime
    trains with (`TrainConfig.bf16`; the loss on the float32 output, as there), both timing modes,
    and record each node's outputs at the dtypes that forward produces (`activation_size`: what a
    stage holds). Recorded in `metadata["profile"]["precision"]`; the cost model then prices boundary
    tensors as the bf16 wire sends them (`graph.precision.wire_bytes`).
    """
    if precision not in PRECISIONS:
        raise ProfileError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if warmup < 0 or iterations < 1:
        raise ProfileError(f"need warmup >= 0 and iterations >= 1, got warmup={warmup}, iterations={iterations}")
    walk = LayerWalk(model, None if device is None else resolve_device(device), (example_inputs, example_kwargs)) \
        if layer_by_layer else None
    if walk is None:
        refuse_meta(model)
    if layer_by_layer_bytes is not None and (walk is None or layer_by_layer_bytes < 1):
        raise ProfileError(f"layer_by_layer_bytes={layer_by_layer_bytes!r} needs layer_by_layer=True and a positive "
                           "number of bytes (the budget of tensors materialized at once)")
    target = walk.device if walk is not None else resolve_device(device, model)
    try:
        check_clock(clock, target)
    except ValueError as error:
        raise ProfileError(str(error)) from None
    mode = timing_mode(timing, target, resumable=store is not None)
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    args, kwargs = to_device(args, target), to_device(kwargs, target)
    started = time.perf_counter()
    with walk.preserved() if walk is not None else preserved_model(model, target), torch.no_grad():
        # Traced with autograd on, as training traces it (api.job, workers): under no_grad torch.export
        # leaves out ops (T5's `contiguous`), and a plan from this graph would miss nodes of theirs.
        with torch.enable_grad():
            graph, gm = walk.trace(args, kwargs, leaf_modules, route) if walk is not None else \
                trace_model(model, args, leaf_modules, example_kwargs=kwargs, route=route)
        known = dict(store.begin(graph)) if store is not None else {}
        instrumented_step_ms: Optional[float] = None
        segmented: dict[str, Any] = {}
        if mode == "insitu":
            cost = instrumentation_cost(clock) if subtract_overhead else Instrumentation()
            overhead = HarnessOverhead(cost.forward_ms, cost.backward_ms)
            bar = tqdm(total=warmup + iterations, desc=f"timing {graph.metadata.get('model', 'model')} training steps",
                       unit="step", disable=not progress, leave=progress, file=sys.stderr)
            try:
                if walk is not None:
                    timings, loss_timing, instrumented_step_ms, segmented = _time_segments(
                        walk, gm, graph, flat_inputs(args, kwargs), loss_fn, warmup, iterations, clock, cost, known,
                        store, bar, layer_by_layer_bytes, precision)
                else:
                    timings, loss_timing, instrumented_step_ms = _time_in_situ(
                        gm, graph, flat_inputs(args, kwargs), loss_fn, warmup, iterations, clock, cost, known, store, bar,
                        precision)
            finally:
                bar.close()
        else:
            overhead = harness_overhead(target, clock) if subtract_overhead else HarnessOverhead()
            replay = Replay(target, warmup=warmup, iterations=iterations, overhead=overhead, clock=clock)
            bar = tqdm(total=len(graph), desc=f"timing {graph.metadata.get('model', 'model')} nodes", unit="node",
                       disable=not progress, leave=progress, file=sys.stderr)
            try:
                interpreter = (walk.interpreter(ReplayInterpreter) if walk is not None else ReplayInterpreter)(
                    gm, graph, replay, bar, store, known)
                with precision_autocast(precision, target):  # the replays and the real forward alike
                    output = output_dicts(interpreter.run(*flat_inputs(args, kwargs)))
            finally:
                bar.close()
            loss_timing = NodeTiming(0.0, 0.0)
            if loss_fn is not None:
                with torch.enable_grad():
                    loss_timing = replay.time(lambda p: loss_fn(float32_output(p["output"]) if precision != "fp32" else p["output"]),
                                              {"output": (output, True)})
            timings = interpreter.timings
        wrap = output_dicts if precision == "fp32" else lambda out: float32_output(output_dicts(out))
        autocast = lambda: precision_autocast(precision, target)  # noqa: E731
        if walk is None:
            saved = record_saved_bytes(gm, flat_inputs(args, kwargs), loss_fn, wrap, autocast)
        else:  # the same rule, one node's tensors materialized at a time
            saving = walk.interpreter(NodeByNodeSaving)(gm, autocast)
            saved = record_saved_bytes_by_node(saving, flat_inputs(args, kwargs), loss_fn, wrap)
        if precision != "fp32":
            graph = _dtypes_at(graph, gm, flat_inputs(args, kwargs), precision, target, walk)
    nodes = tuple(
        replace(node, forward_ms=timings[node.node_id].forward_ms, backward_ms=timings[node.node_id].backward_ms)
        if node.node_id in timings else node
        for node in graph.nodes
    )
    # what autograd keeps for backward, per node (profiler/saved.py)
    nodes = tuple(replace(n, saved_bytes=float(saved.nodes[n.node_id])) if n.node_id in saved.nodes else n for n in nodes)
    seconds = time.perf_counter() - started
    metadata = dict(graph.metadata)
    metadata["profile"] = {
        "device": str(target),
        "warmup": warmup,
        "iterations": iterations,
        "num_threads": torch.get_num_threads(),
        "clock": clock,
        "timing": mode,
        "precision": precision,
        "torch_version": torch.__version__,
        "overhead_subtracted_ms": {"forward": overhead.forward_ms, "backward": overhead.backward_ms},
        "loss_forward_ms": loss_timing.forward_ms,
        "loss_backward_ms": loss_timing.backward_ms,
        "loss_saved_bytes": saved.loss,
        "profiling_seconds": seconds,
    }
    if walk is not None:
        metadata["profile"]["layer_by_layer"] = {**walk.summary(), **(segmented if mode == "insitu" else {})}
    if instrumented_step_ms is not None:  # the whole in-situ step, instrumentation included: what was cut up
        metadata["profile"]["instrumented_step_ms"] = instrumented_step_ms
    logger.info("profiled %d nodes in %.1f s (sum of layer times %.2f ms)", len(nodes), seconds, sum(n.compute_ms for n in nodes))
    return replace(graph, nodes=nodes, metadata=metadata)
