"""In-situ timing: every node's forward and backward measured inside real training steps of the traced model.

Why not replay each operator alone: a transformer's operators take a few microseconds, and an
isolated replay pays per call what a real step does not (input copies, one `autograd.grad` set-up per
operator); on tiny GPT-2/Llama graphs the sum of replays overestimated the step by 1.2-1.9x.

How (CPU, one process):

- **forward**: an `fx.Interpreter` runs the GraphModule with autograd on, as training does. A node's
  forward is the interval between two clock reads around the call of its target alone (arguments are
  looked up and the bookkeeping below runs outside the interval).
- **backward**: each autograd Node (grad_fn) that a graph node's forward created is *owned* by that
  graph node: after the node runs, `next_functions` are walked from its outputs' grad_fns until
  reaching grad_fns an earlier node owns. A pre-hook on each owned grad_fn stamps the clock when the
  engine starts it. On CPU the engine runs one grad_fn at a time on the calling thread, so
  consecutive stamps cut the backward pass into intervals that cover it exactly; each interval is
  charged to the owner of the grad_fn that opens it. That owner thus also pays the engine's routing
  of its gradients, the adds where a value fed two consumers, and the `AccumulateGrad` of the
  parameter gradients it produced (AccumulateGrad runs right after its producer): all work a real
  step does. The interval from `backward()` to the first stamp (engine set-up, the loss's own
  grad_fns) is the loss's.
- the instrumentation's own cost is measured once per process with a trivial operator chain
  (`calibrate_instrumentation`: an empty timed window; one pre-hook, as hooked minus plain
  backward of the same chain) and subtracted per window and per hook. Nothing is scaled to the
  measured step: the instrumented step time is reported beside the sums
  (`InSituProfile.step_ms`), so what the instrumentation adds stays visible.

At bf16 (`autocast`: the runtime's bf16 autocast, `timing.precision_autocast`) the forward pass runs
under it, so each node is timed on the dtypes it computes in when training at that precision.

Per node, the median over the timed steps is kept. Parameter `.grad`s and the GraphModule's buffers
are put back afterwards. CUDA is not supported here (kernels are asynchronous and CUDA backward
runs on the engine's device threads): `model_parallel.profile` replays operators there instead.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from model_parallel.errors import ProfileError
from model_parallel.profiler.timing import NodeTiming, check_clock, tensors_in


@dataclass(frozen=True)
class Instrumentation:
    """What the in-situ instrumentation itself adds (milliseconds): per timed forward window, per backward hook."""

    forward_ms: float = 0.0
    backward_ms: float = 0.0


@dataclass(frozen=True)
class InSituProfile:
    """Medians over the timed steps. `step_ms`: the whole instrumented step (interpreter, hooks and all);
    `backward_ms`: its backward pass, which the nodes' and the loss's backward intervals cut up;
    `grad_fns`: how many autograd Nodes each graph node owned in the last step (0 = no backward work of its own)."""

    timings: dict[str, NodeTiming]
    loss: NodeTiming
    step_ms: float
    backward_ms: float
    grad_fns: dict[str, int]
    steps: int


def stamp_function(clock: str) -> Callable[[], int]:
    """Nanoseconds on `clock`: "wall" (perf_counter) or "cpu" (this process's CPU time, all threads)."""
    return time.process_time_ns if clock == "cpu" else time.perf_counter_ns


def _median_ms(values: Sequence[float]) -> float:
    return float(statistics.median(values)) / 1e6 if values else 0.0


class _StepInterpreter(fx.Interpreter):
    """One forward pass of a training step: times the nodes in `timed`, owns and hooks their grad_fns."""

    def __init__(self, gm: fx.GraphModule, timed: Collection[str], stamp: Callable[[], int]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.timed = timed
        self.stamp = stamp
        self.forward_ns: dict[str, int] = {}
        self.owner: dict[Any, str] = {}  # grad_fn -> graph node id
        self.stamps: list[tuple[int, str]] = []  # (clock, owner) as the backward pass starts each grad_fn

    def run_node(self, n: fx.Node) -> Any:
        if n.name not in self.timed:
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if n.op == "call_module":
                call, call_args = self.fetch_attr(n.target), args
            elif n.op == "call_method":
                call, call_args = getattr(args[0], n.target), args[1:]
            else:
                call, call_args = n.target, args
            dying = self.user_to_last_uses.pop(n, []) if self.garbage_collect_values else []
            try:
                start = self.stamp()
                result = call(*call_args, **kwargs)
                # Values this node used last die here, as they do in a step (`del`, scope exit): their
                # release (allocator, autograd bookkeeping) is part of the node's time.
                del args, kwargs, call_args
                for value in dying:
                    del self.env[value]
                end = self.stamp()
            except Exception as error:  # ran when traced, fails with autograd on: say which node
                raise ProfileError(f"node {n.name} ({n.op} {n.target}) failed in an in-situ training step: "
                                   f"{type(error).__name__}: {error}; profile with timing='replay'") from error
        self.forward_ns[n.name] = end - start
        self._own(result, n.name)
        return result

    def _own(self, value: Any, name: str) -> None:
        append, stamp = self.stamps.append, self.stamp

        def hook(grad_outputs: Any, name: str = name) -> None:
            append((stamp(), name))

        pending = [t.grad_fn for t in tensors_in(value) if t.grad_fn is not None]
        while pending:
            fn = pending.pop()
            if fn is None or fn in self.owner:
                continue
            if type(fn).__name__ == "AccumulateGrad":  # runs right after its producer: that interval has it
                continue
            self.owner[fn] = name
            fn.register_prehook(hook)
            pending.extend(next_fn for next_fn, _ in fn.next_functions)


def _backward_roots(output: Any, loss: Optional[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if loss is not None:
        return [loss], [torch.ones_like(loss)]
    roots = [t for t in tensors_in(output) if t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def run_steps(gm: fx.GraphModule, inputs: Sequence[Any], loss_fn: Optional[Callable[[Any], torch.Tensor]],
              timed: Collection[str], *, warmup: int = 1, iterations: int = 5, clock: str = "wall",
              instrumentation: Instrumentation = Instrumentation(),
              wrap_output: Callable[[Any], Any] = lambda out: out,
              on_step: Optional[Callable[[], None]] = None,
              autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> InSituProfile:
    """Time the nodes named in `timed` in `warmup + iterations` training steps of `gm` (forward, `loss_fn`,
    backward into `.grad`, no optimizer), keeping the median of the last `iterations` per node.
    `wrap_output(output)` is what `loss_fn` receives; `on_step()` is called after each step; the
    forward runs inside `autocast()` (bf16: the runtime's autocast; the loss and backward outside)."""
    check_clock(clock, torch.device("cpu"))
    stamp = stamp_function(clock)
    params = [p for p in gm.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    saved_buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    forward: dict[str, list[int]] = {}
    backward: dict[str, list[int]] = {}
    loss_forward: list[int] = []
    loss_backward: list[int] = []
    steps: list[int] = []
    backward_passes: list[int] = []
    grad_fns: dict[str, int] = {}
    hook_ns, window_ns = instrumentation.backward_ms * 1e6, instrumentation.forward_ms * 1e6
    try:
        with torch.enable_grad():
            for step in range(warmup + iterations):
                for p in params:
                    p.grad = None  # zero_grad(set_to_none=True), as the measured plain step does
                interpreter = _StepInterpreter(gm, timed, stamp)
                started = stamp()
                with autocast():
                    output = interpreter.run(*inputs)
                output = wrap_output(output)
                loss_started = stamp()
                loss = loss_fn(output) if loss_fn is not None else None
                loss_ended = stamp()
                roots, grads = _backward_roots(output, loss)
                backward_started = stamp()
                if roots:
                    try:
                        torch.autograd.backward(roots, grads)
                    except Exception as error:
                        raise ProfileError(f"the backward pass of an in-situ training step failed: "
                                           f"{type(error).__name__}: {error}; profile with timing='replay'") from error
                ended = stamp()
                del output, loss, roots, grads
                if step < warmup:
                    continue
                node_backward = dict.fromkeys(interpreter.forward_ns, 0.0)
                marks = interpreter.stamps
                for index, (at, owner) in enumerate(marks):
                    until = marks[index + 1][0] if index + 1 < len(marks) else ended
                    node_backward[owner] = node_backward.get(owner, 0.0) + (until - at) - hook_ns
                for name, ns in interpreter.forward_ns.items():
                    forward.setdefault(name, []).append(max(0.0, ns - window_ns))
                for name, ns in node_backward.items():
                    backward.setdefault(name, []).append(max(0.0, ns))
                loss_forward.append(max(0.0, loss_ended - loss_started - window_ns))
                loss_backward.append((marks[0][0] if marks else ended) - backward_started)
                steps.append(ended - started)
                backward_passes.append(ended - backward_started)
                grad_fns = {name: 0 for name in interpreter.forward_ns}
                for owner in interpreter.owner.values():
                    grad_fns[owner] = grad_fns.get(owner, 0) + 1
                interpreter.owner.clear()  # drops the grad_fns (and this step's autograd graph) now
                if on_step is not None:
                    on_step()
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        with torch.no_grad():
            for name, buffer in gm.named_buffers():
                if name in saved_buffers:
                    buffer.copy_(saved_buffers[name])
    timings = {name: NodeTiming(_median_ms(forward[name]), _median_ms(backward.get(name, [])))
               for name in forward}
    return InSituProfile(timings=timings, loss=NodeTiming(_median_ms(loss_forward), _median_ms(loss_backward)),
                         step_ms=_median_ms(steps), backward_ms=_median_ms(backward_passes), grad_fns=grad_fns, steps=iterations)


def calibrate_instrumentation(clock: str = "wall", length: int = 64, repeats: int = 15, rounds: int = 5) -> Instrumentation:
    """The in-situ instrumentation's own cost on this machine, measured on a chain of `length` trivial
    operators: an empty timed window (forward), and backward with a pre-hook on every grad_fn minus
    the same backward without (per hook). Rounds interleave both so background load hits them alike;
    each keeps its quietest round's median."""
    check_clock(clock, torch.device("cpu"))
    stamp = stamp_function(clock)
    x = torch.zeros(1, requires_grad=True)
    windows: list[int] = []
    plain: list[float] = []
    hooked: list[float] = []
    with torch.enable_grad():
        for _ in range(rounds):
            for _ in range(200):
                start = stamp()
                end = stamp()
                windows.append(end - start)
            for hooks, into in ((False, plain), (True, hooked)):
                times = []
                for _ in range(repeats):
                    stamps: list[tuple[int, str]] = []
                    append = stamps.append

                    def hook(grad_outputs: Any, name: str = "node") -> None:
                        append((stamp(), name))

                    y = x
                    for _ in range(length):
                        y = y * 1.0
                        if hooks:
                            y.grad_fn.register_prehook(hook)
                    start = stamp()
                    y.backward()
                    times.append(stamp() - start)
                into.append(statistics.median(times))
    per_hook = max(0.0, (min(hooked) - min(plain)) / length)
    return Instrumentation(forward_ms=statistics.median(windows) / 1e6, backward_ms=per_hook / 1e6)
