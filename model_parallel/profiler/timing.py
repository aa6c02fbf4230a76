"""Timers for the profiler: replay one operator in isolation (forward and backward), a plain training step,
and the fixed per-call cost of the replay harness that is subtracted from every node.

At precision "bf16" forwards run under `precision_autocast` (the runtime's autocast: runtime/step/executor.py)
and the loss gets the output in float32 (`float32_output`), as the runtime's last stage gives it.

Every timed region is bracketed by a device synchronisation (`torch.cuda.synchronize` on CUDA, nothing
on CPU), so asynchronous kernels are counted where they run, not where they are launched.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from model_parallel.errors import ProfileError
from model_parallel.graph.core import Graph


@dataclass(frozen=True)
class NodeTiming:
    """Median milliseconds of one operator's forward and backward at the profiled batch size."""

    forward_ms: float
    backward_ms: float


@dataclass(frozen=True)
class HarnessOverhead:
    """What the isolated replay pays per call that a real training step does not (milliseconds).

    A training step runs one backward pass for the whole model; the replay starts one per operator,
    and each start (graph task set-up, input validation, result capture) costs 10-30 us on CPU.
    Small models have hundreds of sub-millisecond operators, so this is subtracted from each node.
    """

    forward_ms: float = 0.0
    backward_ms: float = 0.0


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (a no-op on CPU, where kernels run synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = ("wall", "cpu")


def check_clock(clock: str, device: torch.device) -> None:
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if clock == "cpu" and device.type != "cpu":
        raise ValueError(f"clock 'cpu' measures this process's CPU time and cannot time {device.type} kernels; use 'wall'")


def clock_seconds(clock: str = "wall") -> float:
    """Seconds on `clock` (no device sync): for timing long stretches such as a whole profiling pass."""
    return time.process_time() if clock == "cpu" else time.perf_counter()


def _now_ms(device: torch.device, clock: str = "wall") -> float:
    """Milliseconds on `clock`: "wall" (perf_counter, after a device sync) or "cpu" (CPU time of all this
    process's threads: on a shared machine, time other processes take from us is not counted)."""
    synchronize(device)
    if clock == "cpu":
        return time.process_time_ns() / 1e6
    return time.perf_counter_ns() / 1e6


def precision_autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """The context a forward runs in at `precision`: bf16 autocast on the device's type exactly as the
    runtime enters it (`StepExecutor.forward`), nothing at fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def float32_output(value: Any) -> Any:
    """`value` with its floating-point tensors in float32 (runtime/step/output.py `float_output`: what the
    criterion gets after a bf16 forward). Tensors already float32 are returned as they are."""
    return tree_map(lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v, value)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) value: an op's output or its arguments."""
    leaves, _ = tree_flatten(value)
    return [v for v in leaves if isinstance(v, torch.Tensor)]


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


class Replay:
    """Runs one operator `warmup + iterations` times on fresh copies of its inputs and times it.

    `inputs` maps an input key to (value, requires_grad): the value as the real forward pass produced
    it, and whether real training would track gradients through it (it depends on parameters). Each
    iteration copies the inputs outside the timed region, makes the gradient-tracking ones leaves and
    hands the operator a `leaf.clone()` of them, so in-place operators (`ReLU(inplace=True)`,
    `out += identity`) work exactly as inside the model. Backward computes what real training
    computes there: gradients for the tracked inputs and for the operator's own parameters.
    """

    def __init__(self, device: torch.device, warmup: int, iterations: int, overhead: HarnessOverhead = HarnessOverhead(),
                 clock: str = "wall") -> None:
        check_clock(clock, device)
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.device = device
        self.warmup = warmup
        self.iterations = iterations
        self.overhead = overhead
        self.clock = clock

    def _prepare(self, inputs: dict[str, tuple[Any, bool]]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        leaves: list[torch.Tensor] = []

        def copy(value: Any, requires_grad: bool) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            leaf = value.detach().clone()
            if requires_grad and _differentiable(leaf):
                leaf.requires_grad_(True)
                leaves.append(leaf)
                # The op gets a non-leaf copy: in-place operators refuse leaves that require grad.
                return leaf.clone()
            return leaf

        prepared = {key: tree_map(lambda v, g=grad: copy(v, g), value) for key, (value, grad) in inputs.items()}
        return prepared, leaves

    def time(self, run: Callable[[dict[str, Any]], Any], inputs: dict[str, tuple[Any, bool]], parameters: Sequence[torch.Tensor] = ()) -> NodeTiming:
        """Time `run(prepared_inputs)`; `parameters` are the operator's own weights (gradients computed)."""
        params = [p for p in parameters if p.requires_grad]
        forward: list[float] = []
        backward: list[float] = []
        for iteration in range(self.warmup + self.iterations):
            prepared, leaves = self._prepare(inputs)
            start = _now_ms(self.device, self.clock)
            output = run(prepared)
            middle = _now_ms(self.device, self.clock)
            roots = [t for t in tensors_in(output) if t.requires_grad]
            backward_ms = 0.0
            if roots:
                grads = [torch.ones_like(t) for t in roots]
                targets = leaves + params
                begin = _now_ms(self.device, self.clock)
                # autograd.grad (not .backward): no accumulation into the copied inputs, which real
                # training does not do either; parameter gradients are computed all the same.
                torch.autograd.grad(roots, targets, grad_outputs=grads, allow_unused=True)
                backward_ms = _now_ms(self.device, self.clock) - begin
            del output, roots, prepared, leaves
            if iteration >= self.warmup:
                forward.append(middle - start)
                backward.append(backward_ms)
        fwd = max(0.0, median(forward) - self.overhead.forward_ms)
        bwd = median(backward)
        if bwd > 0:
            bwd = max(0.0, bwd - self.overhead.backward_ms)
        return NodeTiming(forward_ms=fwd, backward_ms=bwd)


def calibrate_overhead(device: torch.device, repeats: int = 30, clock: str = "wall") -> HarnessOverhead:
    """Measure the replay's fixed per-call cost with a trivial operator.

    The cost of a tiny op replayed alone is its own cost plus the harness's; the same op's cost inside
    one long chain (what a training step sees) is the slope of chain time over chain length. The
    difference is the harness overhead, measured for forward and backward separately.
    """
    x = torch.zeros(1, device=device)
    long_chain = 17

    def chain(length: int) -> Callable[[dict[str, Any]], Any]:
        def run(inputs: dict[str, Any]) -> Any:
            y = inputs["x"]
            for _ in range(length):
                y = y * 1.0
            return y

        return run

    replay = Replay(device, warmup=5, iterations=repeats, clock=clock)
    # Interleave short and long chains in rounds so background load hits both alike, and keep each
    # one's quietest round (the median within a round already drops single preemptions).
    shorts: list[NodeTiming] = []
    longs: list[NodeTiming] = []
    for _ in range(5):
        shorts.append(replay.time(chain(1), {"x": (x, True)}))
        longs.append(replay.time(chain(long_chain), {"x": (x, True)}))
    short_f = min(t.forward_ms for t in shorts)
    short_b = min(t.backward_ms for t in shorts)
    per_op_f = (min(t.forward_ms for t in longs) - short_f) / (long_chain - 1)
    per_op_b = (min(t.backward_ms for t in longs) - short_b) / (long_chain - 1)
    return HarnessOverhead(forward_ms=max(0.0, short_f - per_op_f), backward_ms=max(0.0, short_b - per_op_b))


def training_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Optional[Callable[[Any], torch.Tensor]],
                  zero_grad: bool = True, precision: str = "fp32") -> None:
    """One plain training step without the optimizer: zero_grad(set_to_none), forward (under autocast at
    bf16, the loss on its float32 output), loss, backward."""
    if zero_grad:
        model.zero_grad(set_to_none=True)
    with precision_autocast(precision, _device_of(model)):
        output = model(*inputs)
    if precision != "fp32":
        output = float32_output(output)
    if loss_fn is not None:
        loss_fn(output).backward()
        return
    roots = [t for t in tensors_in(output) if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


def _device_of(model: nn.Module) -> torch.device:
    return next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))


def time_training_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Optional[Callable[[Any], torch.Tensor]],
                       device: torch.device, iterations: int, clock: str = "wall",
                       on_step: Optional[Callable[[float], None]] = None, precision: str = "fp32") -> list[float]:
    """Milliseconds of each of `iterations` plain training steps: forward, loss, backward (the caller
    restores model state); `on_step(ms)` is called after each one (a progress bar: a step of a large
    model takes minutes). `zero_grad` runs before the clock starts: it is the optimizer's work, not
    forward or backward, and no node's (0.1 ms of a 2 ms tiny-OPT step: a Python walk over modules)."""
    check_clock(clock, device)
    times: list[float] = []
    for _ in range(iterations):
        model.zero_grad(set_to_none=True)
        start = _now_ms(device, clock)
        training_step(model, inputs, loss_fn, zero_grad=False, precision=precision)
        times.append(_now_ms(device, clock) - start)
        if on_step is not None:
            on_step(times[-1])
    return times


class ReplayInterpreter(fx.Interpreter):
    """Runs the traced model once under no_grad (values freed after their last use) and, before each
    operator runs for real, replays it in isolation to time its forward and backward."""

    def __init__(self, gm: fx.GraphModule, graph: Graph, replay: Replay, progress: Optional[Any],
                 store: Optional[Any] = None, known: Optional[Mapping[str, NodeTiming]] = None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.op_graph = graph
        self.replay = replay
        self.progress = progress
        self.store = store
        self.known = known or {}
        self.timings: dict[str, NodeTiming] = {}
        # Whether real training tracks gradients through each value: it depends on a parameter.
        self.needs_grad: dict[str, bool] = {}
        self.modules = dict(gm.named_modules())

    def _own_parameters(self, n: fx.Node) -> list[torch.Tensor]:
        if n.op == "call_module":
            return list(self.modules[n.target].parameters())
        return []

    def run_node(self, n: fx.Node) -> Any:
        inputs_need_grad = any(self.needs_grad.get(i.name, False) for i in n.all_input_nodes)
        own = self._own_parameters(n)
        has_tensor_output = bool(self.op_graph[n.name].layer.outputs) if n.op != "output" else False
        if n.name in self.known:  # timed by an earlier, interrupted run: the real forward below still runs
            self.timings[n.name] = self.known[n.name]
        elif n.op not in ("placeholder", "get_attr", "output") and has_tensor_output:
            inputs = {i.name: (self.env[i], self.needs_grad.get(i.name, False)) for i in n.all_input_nodes}

            def run(prepared: dict[str, Any], n: fx.Node = n) -> Any:
                args = fx.node.map_arg(n.args, lambda a: prepared[a.name])
                kwargs = fx.node.map_arg(n.kwargs, lambda a: prepared[a.name])
                return getattr(self, n.op)(n.target, args, kwargs)

            try:
                with torch.enable_grad():
                    self.timings[n.name] = self.replay.time(run, inputs, own)
            except Exception as error:  # the op failed alone although it ran in the model: say which
                raise ProfileError(
                    f"node {n.name} ({n.op} {n.target}): replaying it in isolation failed: {type(error).__name__}: {error}"
                ) from error
            if self.store is not None:
                self.store.record(n.name, self.timings[n.name])
        result = super().run_node(n)
        if n.op == "placeholder":
            self.needs_grad[n.name] = any(t.requires_grad for t in tensors_in(result))
        elif n.op == "get_attr":
            self.needs_grad[n.name] = isinstance(result, torch.Tensor) and result.requires_grad
        else:
            self.needs_grad[n.name] = inputs_need_grad or any(p.requires_grad for p in own)
        if self.progress is not None and n.op != "output":
            self.progress.update(1)
        return result
