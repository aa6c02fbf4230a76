"""Layer-by-layer in-situ timing: the training step of a meta-traced model, run segment by segment.

`profile(..., layer_by_layer=True)` on the CPU. Isolated replay overestimates microsecond-scale
operators (profiler.insitu), so the walk times nodes inside training steps too, but of a *segment*
of the graph at a time: the nodes are cut, in topological order, into segments whose materialized
tensors fit a byte budget, and

    segment k:  materialize the tensors its nodes read                   (LayerWalk: model values / init rule)
                warmup + iterations training steps of the segment alone  (insitu.run_steps, the same stamping)
                  forward on the real activations entering it, backward from a gradient of ones for the
                  outputs later segments read (the last segment: from the loss, as a whole step)
                keep those outputs (detached), free its tensors          (activations after their last reader)

so the peak is one segment's tensors (<= budget) plus the live activations. A boundary activation
enters as a detached leaf that requires grad where training differentiates it, through a `_fresh`
clone (an in-place operator on a leaf that requires grad fails; mid-step it does not). That clone is
timed as a node of its own and dropped: its forward, its backward (the pass-through and the leaf's
gradient accumulation) and the end of the segment's backward pass, which the first node's interval
would otherwise pay once per segment. The engine's start-up per backward pass is the interval before
the first stamp (`InSituProfile.loss`) and is dropped for all but the last segment. Both are reported
(`boundary_ms`). Backward cost does not depend on gradient values for dense operators, so the ones
stand in for the real upstream gradients.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from model_parallel.errors import ProfileError
from model_parallel.profiler.insitu import Instrumentation, run_steps
from model_parallel.profiler.layer_by_layer import LayerWalk
from model_parallel.profiler.timing import NodeTiming, tensors_in

BUDGET_SHARE = 8  # default budget: 1/8 of the model's tensor bytes (never below its largest node)
_SKIP = ("placeholder", "output", "get_attr")


@dataclass(frozen=True)
class Segment:
    """Graph nodes run together, in topological order, and the tensor bytes they materialize."""

    nodes: tuple[fx.Node, ...]
    tensor_bytes: int


@dataclass(frozen=True)
class SegmentedProfile:
    """Per node medians (graph node ids), the loss's (last segment), the instrumented steps summed over
    segments, and what the boundaries cost (dropped from the node times)."""

    timings: dict[str, NodeTiming]
    loss: NodeTiming
    step_ms: float
    boundary_ms: float
    budget_bytes: int
    segments: int


def _reads(walk: LayerWalk, node: fx.Node, held: set[str]) -> tuple[int, set[str]]:
    """Bytes `node` adds to a segment already holding the targets `held`, and the targets it reads."""
    readers = [node, *(i for i in node.all_input_nodes if i.op == "get_attr")]
    targets = {str(r.target): r for r in readers if r.op in ("call_module", "get_attr")}
    return sum(walk.tensor_bytes(r) for t, r in targets.items() if t not in held), set(targets)


def budget_bytes(walk: LayerWalk, gm: fx.GraphModule, requested: Optional[int] = None) -> int:
    """`requested` (default: 1/8 of the model's tensor bytes), never below the largest node's."""
    nodes = [n for n in gm.graph.nodes if n.op not in _SKIP]
    largest = max((_reads(walk, n, set())[0] for n in nodes), default=0)
    if requested is None:
        readers = {str(n.target): n for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
        requested = sum(walk.tensor_bytes(n) for n in readers.values()) // BUDGET_SHARE
    return max(largest, requested, 1)


def plan_segments(walk: LayerWalk, gm: fx.GraphModule, budget: int) -> list[Segment]:
    """Greedy cut in topological order: a segment takes nodes while their tensors fit `budget`."""
    segments: list[Segment] = []
    nodes: list[fx.Node] = []
    held: set[str] = set()
    size = 0
    for node in gm.graph.nodes:
        if node.op in _SKIP:
            continue
        cost, targets = _reads(walk, node, held)
        if nodes and size + cost > budget:
            segments.append(Segment(tuple(nodes), size))
            nodes, held, size = [], set(), 0
            cost, targets = _reads(walk, node, held)
        nodes.append(node)
        held |= targets
        size += cost
    segments.append(Segment(tuple(nodes), size))  # (the last one also computes the output, maybe from nothing)
    return segments


def _ms(timing: NodeTiming) -> float:
    return timing.forward_ms + timing.backward_ms


def _fresh(value: Any) -> Any:
    """A boundary activation as a non-leaf, as it is mid-step (see the module docstring)."""
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v, value)


def _detached(value: Any) -> Any:
    """`value` without its autograd history; a tensor training differentiates stays a leaf that requires grad."""
    def one(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        out = v.detach()
        return out.requires_grad_() if v.requires_grad else out
    return tree_map(one, value)


@dataclass
class _Piece:
    """One segment as a GraphModule of its own: inputs (graph nodes) in placeholder order, the outputs
    later segments read, and the sub-graph's node names -> graph node ids."""

    graph: fx.Graph
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    names: dict[str, str]
    boundary: set[str]
    modules: list[str]
    attrs: list[str]


def _piece(segment: Segment, index: int, position: Mapping[fx.Node, int], output: Optional[fx.Node],
           values: Mapping[fx.Node, Any]) -> _Piece:
    members = set(segment.nodes)
    readers = [*segment.nodes, *([output] if output is not None else [])]
    external: dict[fx.Node, None] = {}
    attrs: dict[fx.Node, None] = {}
    for node in readers:
        for i in node.all_input_nodes:
            if i not in members:
                (attrs if i.op == "get_attr" else external)[i] = None
    graph = fx.Graph()
    env = {i: graph.placeholder(i.name) for i in external}
    boundary = set()
    for i in external:
        if i.op != "placeholder" and any(t.requires_grad for t in tensors_in(values[i])):
            env[i] = graph.call_function(_fresh, (env[i],))
            boundary.add(env[i].name)
    for a in attrs:
        env[a] = graph.get_attr(str(a.target))
    names = {}
    for node in segment.nodes:
        env[node] = graph.node_copy(node, lambda i: env[i])
        names[env[node].name] = node.name
    outputs = [n for n in segment.nodes if any(u.op == "output" or position.get(u, index) > index for u in n.users)]
    if output is not None:
        graph.output(fx.node.map_arg(output.args[0], lambda i: env[i]))
    else:
        graph.output(tuple(env[n] for n in outputs))
    modules = list(dict.fromkeys(str(n.target) for n in segment.nodes if n.op == "call_module"))
    return _Piece(graph, list(external), outputs, names, boundary, modules, [str(a.target) for a in attrs])


@contextmanager
def _collect_new_objects_only() -> Iterator[None]:
    """Every object alive before the segments run is left out of the collections after each segment (`gc.freeze`).
    A full collection walks the whole heap, once per segment: with 4 million objects alive (a process with transformers
    and a dataset loaded has millions) the zoo's GPT, 11 segments, profiled in 7.0 s, 6.2 of them collecting; 0.7 s
    with the freeze. The garbage a segment leaves is its own, made after the freeze. Not when something else froze
    the heap already: unfreezing would undo its freeze."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_segments(walk: LayerWalk, gm: fx.GraphModule, inputs: Sequence[Any], loss_fn: Optional[Callable[[Any], torch.Tensor]],
                 timed: Collection[str], *, budget: Optional[int] = None, warmup: int = 1, iterations: int = 5,
                 clock: str = "wall", instrumentation: Instrumentation = Instrumentation(),
                 wrap_output: Callable[[Any], Any] = lambda out: out, known: Mapping[str, NodeTiming] = {},
                 record: Optional[Callable[[str, NodeTiming], None]] = None,
                 on_step: Optional[Callable[[], None]] = None,
                 autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> SegmentedProfile:
    """Time the nodes named in `timed` segment by segment (see the module docstring). A segment whose
    timed nodes are all in `known` runs its forward once, untimed; `record(node_id, timing)` sees each one measured."""
    limit = budget_bytes(walk, gm, budget)
    segments = plan_segments(walk, gm, limit)
    position = {n: k for k, s in enumerate(segments) for n in s.nodes}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    last_read: dict[fx.Node, int] = {}
    for k, segment in enumerate(segments):
        for node in segment.nodes:
            for i in node.all_input_nodes:
                last_read[i] = k
    for i in output.all_input_nodes:
        last_read[i] = len(segments) - 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) > len(placeholders):
        raise ProfileError(f"layer_by_layer: {len(inputs)} inputs for a graph of {len(placeholders)} placeholders")
    values: dict[fx.Node, Any] = {n: inputs[k] if k < len(inputs) else (n.args[0] if n.args else None)
                                  for k, n in enumerate(placeholders)}
    timings: dict[str, NodeTiming] = {}
    loss, step_ms, boundary_ms = NodeTiming(0.0, 0.0), 0.0, 0.0
    with _collect_new_objects_only():
        for k, segment in enumerate(segments):
            final = k == len(segments) - 1
            piece = _piece(segment, k, position, output if final else None, values)
            args = [values[i] for i in piece.inputs]
            leaves = [t for t in tensors_in(args) if t.requires_grad]
            kept: list[Any] = []

            def keep(out: Any) -> Any:
                kept[:] = [_detached(out)]
                return out

            def stepped() -> None:
                for leaf in leaves:  # the boundary's gradient is not accumulated across steps
                    leaf.grad = None
                if on_step is not None:
                    on_step()

            mine = {piece_name for piece_name, node_id in piece.names.items() if node_id in timed}
            with ExitStack() as stack, torch.enable_grad():
                root: dict[str, Any] = {t: stack.enter_context(walk.materialized_module(t)) for t in piece.modules}
                root.update({t: walk.fetch(t) for t in piece.attrs})
                sub = fx.GraphModule(root, piece.graph, class_name=f"Segment{k}")
                del root
                if mine and all(piece.names[name] in known for name in mine):
                    with autocast():
                        out = sub(*args)
                    kept = [None if final else _detached(out)]
                    for name in mine:
                        timings[piece.names[name]] = known[piece.names[name]]
                else:
                    result = run_steps(sub, args, loss_fn if final else None, mine | piece.boundary, warmup=warmup,
                                       iterations=iterations, clock=clock, instrumentation=instrumentation,
                                       wrap_output=wrap_output if final else keep, on_step=stepped, autocast=autocast)
                    for name in mine:
                        timings[piece.names[name]] = result.timings[name]
                        if record is not None:
                            record(piece.names[name], result.timings[name])
                    boundary_ms += sum(_ms(result.timings[b]) for b in piece.boundary)
                    if final:
                        loss = result.loss
                    else:
                        boundary_ms += _ms(result.loss)
                    step_ms += result.step_ms
                del sub, args
            if not final:
                values.update(zip(piece.outputs, kept[0]))
            for node in [n for n in values if last_read.get(n, -1) <= k]:
                del values[node]
            kept.clear()
            del piece  # (its graph's owning module is the segment's GraphModule, which holds the tensors)
            gc.collect()  # the segment's tensors are counted until collected: free them before the next segment
    return SegmentedProfile(timings=timings, loss=loss, step_ms=step_ms, boundary_ms=boundary_ms,
                            budget_bytes=limit, segments=len(segments))
