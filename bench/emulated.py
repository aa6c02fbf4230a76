"""Emulated devices: layers whose compute is a calibrated wait, and the analytic bubble of each schedule.

An `EmulatedLayer` computes `x * w` (a tiny elementwise product: real autograd, real messages,
almost no CPU) and waits a set time in each of its three parts, through autograd:

    forward            waits forward_ms   (on the input's path)
    input gradient     waits input_ms     (backward of the input's path: dL/dx)
    weight gradient    waits weight_ms    (backward of the weight's path: dL/dw)

The input and weight gradients sit on separate autograd nodes, so a schedule that splits them
(torch's zero-bubble stages call `autograd.grad` for the inputs first and the weights later) really
splits the wait. Waits sleep, which frees the core: with 4-8 ranks on 2 cores every rank then behaves
like a device of its own, and a bubble or a straggler costs what it costs on dedicated accelerators.
Each wait adds the time it actually took (perf_counter) to `BUSY`, this process's emulated busy time,
so the busy time per rank is known for both runtimes alike. `SCALE` stretches every wait (a straggler).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


@dataclass
class Clock:
    """This process's emulated device: `busy_ms` waited so far, each wait stretched by `scale`."""

    busy_ms: float = 0.0
    scale: float = 1.0


BUSY = Clock()


def wait(ms: float, clock: Clock = BUSY) -> float:
    """Sleep `ms` x clock.scale and add the time actually waited to clock.busy_ms; returns it (ms).
    A sleep can overshoot under load, never undershoot: counting the real wait keeps busy honest."""
    target = ms * clock.scale
    if target <= 0.0:
        return 0.0
    start = time.perf_counter()
    time.sleep(target / 1000.0)
    waited = (time.perf_counter() - start) * 1000.0
    clock.busy_ms += waited
    return waited


class _InputPath(torch.autograd.Function):
    """Identity on the activation: forward waits forward_ms, its backward (dL/dx) waits input_ms."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_ms: float, input_ms: float) -> torch.Tensor:
        ctx.input_ms = input_ms
        wait(forward_ms)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        wait(ctx.input_ms)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    """Identity on the weight: its backward (dL/dw) waits weight_ms."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, weight_ms: float) -> torch.Tensor:
        ctx.weight_ms = weight_ms
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        wait(ctx.weight_ms)
        return grad, None


class EmulatedLayer(nn.Module):
    """`x * w` (w: `width` ones) that waits forward_ms / input_ms / weight_ms in forward / dL/dx / dL/dw."""

    def __init__(self, width: int, forward_ms: float, input_ms: float, weight_ms: float) -> None:
        super().__init__()
        if min(forward_ms, input_ms, weight_ms) < 0:
            raise ValueError(f"waits must be >= 0 ms, got forward {forward_ms}, input {input_ms}, weight {weight_ms}")
        self.width, self.forward_ms, self.input_ms, self.weight_ms = width, forward_ms, input_ms, weight_ms
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InputPath.apply(x, self.forward_ms, self.input_ms) * _WeightPath.apply(self.weight, self.weight_ms)

    def extra_repr(self) -> str:
        return f"{self.width}, forward_ms={self.forward_ms}, input_ms={self.input_ms}, weight_ms={self.weight_ms}"


class EmulatedModel(nn.Module):
    """`num_layers` EmulatedLayers under flat names `layer0..` (uniform cost: any split is a count of layers)."""

    def __init__(self, num_layers: int, width: int, forward_ms: float, input_ms: float, weight_ms: float) -> None:
        super().__init__()
        self.num_layers = num_layers
        for index in range(num_layers):
            setattr(self, f"layer{index}", EmulatedLayer(width, forward_ms, input_ms, weight_ms))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in range(self.num_layers):
            x = getattr(self, f"layer{index}")(x)
        return x


# ----------------------------------------------------------------------------- analytic bubbles
# Times per rank and microbatch (all of a rank's stages together): f forward, b input gradient, w weight
# gradient. Bubble = idle share of one step on a rank, in steady pipelines with equal stages:
#   GPipe, 1F1B (Huang et al. 2019; Narayanan et al. 2021):   (p-1) / (m + p-1)
#   interleaved 1F1B, looped BFS, v stages per rank (Narayanan et al. 2021, "Efficient large-scale
#     language model training", section 2.2; Lamy-Poirier 2023 for BFS):   (p-1) / (v m + p-1)
#   ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", table 1): idle (p-1)(f+b-w)
#   ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): idle (p-1)(f+b-2w)/v, v = 2
#     chunks per rank, whose per-chunk times are f/v, b/v, w/v
#   torch's interleaved zero bubble: ZB-H1's idle over v chunks (an approximation; no published closed form)
#   DualPipeV and pipedream (no flush): none given (None).

@dataclass(frozen=True)
class BubbleCase:
    """A schedule's shape for the analytic bubble: p ranks, m microbatches, v stages per rank, f/b/w ms."""

    kind: str  # "flush" | "interleaved" | "zb_h1" | "zb_interleaved" | "zb_v" | "none"
    p: int
    m: int
    v: int = 1
    f: float = 1.0
    b: float = 1.0
    w: float = 1.0


def analytic_bubble(case: BubbleCase) -> Optional[float]:
    """The idle share of a step per rank (0..1) for `case`, or None where no formula is given."""
    p, m, v, f, b, w = case.p, case.m, case.v, case.f, case.b, case.w
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    work = m * (f + b + w)
    if case.kind == "flush":
        idle = (p - 1) * (f + b + w)
    elif case.kind == "interleaved":
        idle = (p - 1) * (f + b + w) / v
    elif case.kind == "zb_h1":
        idle = (p - 1) * max(f + b - w, 0.0)
    elif case.kind == "zb_interleaved":
        idle = (p - 1) * max(f + b - w, 0.0) / v
    elif case.kind == "zb_v":
        idle = (p - 1) * max(f + b - 2 * w, 0.0) / v
    elif case.kind == "none":
        return None
    else:
        raise ValueError(f"unknown bubble kind {case.kind!r}")
    return idle / (work + idle)


def straggler_ceiling(p: int, slowdown: float) -> float:
    """The share of its speed a p-rank pipeline can keep when one rank runs `slowdown` x slower: (p - 1 + 1/s) / p."""
    if p < 1 or slowdown < 1.0:
        raise ValueError(f"need p >= 1 and slowdown >= 1, got p={p}, slowdown={slowdown}")
    return (p - 1 + 1.0 / slowdown) / p


# ---- what a plan can reach under a schedule (the straggler row's honest bound) ------------------------
# The ceiling above is a throughput limit: it assumes fill and drain vanish. A flush step of m
# microbatches still pays them, on unequal stages too, so the best contiguous plan under 1F1B at
# p = 4, m = 8, s = 2 reaches 1.40x the static plan (0.80 of the 1.75 ceiling), with 6 layers per
# rank or 16 alike: the gap is the schedule's bubble, not the split's granularity.

def simulate_step(rows: Sequence[Sequence[Any]], forward_ms: Sequence[float], backward_ms: Sequence[float],
                  stage_rows: Optional[Sequence[int]] = None, weight_share: float = 0.0) -> float:
    """The makespan (ms) of one flush step: `rows[r]` is row r's actions in order (row r holds stage r unless
    `stage_rows` says which row holds each stage), stage k's forward and backward take forward_ms[k] and
    backward_ms[k], of which a split backward's W takes `weight_share`; no message latency (optimizer/simulate.py,
    the simulator auto uses)."""
    return _simulation(rows, forward_ms, backward_ms, stage_rows, weight_share).makespan_ms


def _simulation(rows: Sequence[Sequence[Any]], forward_ms: Sequence[float], backward_ms: Sequence[float],
                stage_rows: Optional[Sequence[int]], weight_share: float) -> Any:
    from model_parallel.optimizer.simulate import StageTimes

    times = [StageTimes(f, b, b * (1.0 - weight_share), b * weight_share) for f, b in zip(forward_ms, backward_ms)]
    return _simulate_times(rows, list(stage_rows) if stage_rows is not None else list(range(len(rows))), times)


def _simulate_times(rows: Sequence[Sequence[Any]], stage_rows: Sequence[int], times: Sequence[Any]) -> Any:
    """optimizer/simulate.py's simulation; a deadlock (not a valid schedule) as a ValueError saying so."""
    from model_parallel.errors import ScheduleError
    from model_parallel.optimizer.simulate import simulate

    try:
        return simulate(rows, stage_rows, times)
    except ScheduleError as error:
        if "deadlock" not in str(error):
            raise
        raise ValueError(f"the rows wait on each other forever (not a valid schedule): {error}") from None


def one_f_one_b_step(layers: Sequence[int], scale: Sequence[float], m: int, layer_f: float, layer_b: float) -> float:
    """One 1F1B step (ms) of stages of `layers[k]` emulated layers on rank k, slowed by scale[k]."""
    from model_parallel.runtime.step.schedule import one_f_one_b

    p = len(layers)
    schedule = one_f_one_b(p, m)
    return simulate_step([schedule.stage_actions(k) for k in range(p)], [n * layer_f * s for n, s in zip(layers, scale)],
                         [n * layer_b * s for n, s in zip(layers, scale)])


def schedule_step(name: str, layers: Sequence[int], rank_scale: Sequence[float], m: int, layer_f: float,
                  layer_i: float, layer_w: float, order_times: Optional[Sequence[Any]] = None) -> float:
    """One step (ms) of our schedule `name` (runtime/step: 1f1b, interleaved, zbinterleaved, ...) over len(layers)
    stages on len(rank_scale) ranks, stage k of `layers[k]` emulated layers, each rank's waits stretched by its scale."""
    return schedule_simulation(name, layers, rank_scale, m, layer_f, layer_i, layer_w, order_times).makespan_ms


def schedule_simulation(name: str, layers: Sequence[int], rank_scale: Sequence[float], m: int, layer_f: float,
                        layer_i: float, layer_w: float, order_times: Optional[Sequence[Any]] = None,
                        list_order: bool = True, as_run: bool = False) -> Any:
    """`schedule_step`'s whole simulation (optimizer/simulate.Simulation: per-rank busy ms and bubbles too), in the
    order our runtime runs: zero bubble's list-built where it is faster (runtime/step/list_order.py) from
    `order_times` (the StageTimes the workers get: a plan's `stage_times`), by default from these times;
    `list_order` False: the schedule's fixed order (torch's, what torch's runtime runs). `as_run`: stage 0's
    input gradient one layer shorter, as both runtimes run it (the model's input needs no gradient, so the first
    layer waits no I): what a measured bubble is compared with, rank 0 included."""
    return _simulate_times(*schedule_rows(name, layers, rank_scale, m, layer_f, layer_i, layer_w, order_times,
                                          list_order, as_run))


def schedule_rows(name: str, layers: Sequence[int], rank_scale: Sequence[float], m: int, layer_f: float,
                  layer_i: float, layer_w: float, order_times: Optional[Sequence[Any]] = None, list_order: bool = True,
                  as_run: bool = False) -> tuple[list[list[Any]], list[int], list[Any]]:
    """What `schedule_simulation` simulates: each rank's order, the rank of each stage, each stage's StageTimes."""
    from model_parallel.optimizer.simulate import StageTimes
    from model_parallel.runtime.step.interleaved import run_schedule
    from model_parallel.runtime.step.list_order import timed_schedule

    schedule = run_schedule(name, len(layers), m, len(rank_scale))
    stage_rows = [schedule.row_of(k) for k in range(len(layers))]
    scale = [rank_scale[r] for r in stage_rows]
    inputs = [n - (1 if as_run and k == 0 else 0) for k, n in enumerate(layers)]  # layers that wait an I
    own = [StageTimes(n * layer_f * s, (i * layer_i + n * layer_w) * s, i * layer_i * s, n * layer_w * s)
           for n, i, s in zip(layers, inputs, scale)]
    if list_order:
        schedule = timed_schedule(schedule, order_times or own)
    return [schedule.row_actions(r) for r in range(schedule.num_rows)], stage_rows, own


@dataclass(frozen=True)
class _Shifted:
    """An action of a later step: its microbatch numbered after the earlier steps' (the simulator's key)."""

    stage: int
    kind: str
    microbatch: int


@dataclass(frozen=True)
class Periodic:
    """Steps run back to back: one step alone (`one`, its makespan and bubbles), the period (ms from one step's start
    to the next's) and each rank's bubble over it."""

    one: Any  # optimizer.simulate.Simulation
    period_ms: float
    bubbles: tuple[float, ...]


def periodic(rows: Sequence[Sequence[Any]], stage_rows: Sequence[int], times: Sequence[Any], m: int,
             steps: int = 4) -> Periodic:
    """Neither runtime puts a barrier between steps: a rank starts step k+1 once its own update is done and its inputs
    are there. So consecutive steps overlap where an order ends late on the ranks that start the next step late (a
    V: its last actions are on rank p - 1, whose first one waits p - 1 hops), and the period is shorter than one
    step's makespan, the single-step simulation's yardstick (ZBV at p = 4, m = 8, 8 ms layers: makespan 816 ms, period
    768 ms). Simulated as `steps` steps in a row (each rank's order repeated; a stage's update needs nothing from
    another rank), period = (makespan of `steps` - makespan of one) / (steps - 1)."""
    one = _simulate_times(rows, stage_rows, times)
    many = _simulate_times([[_Shifted(a.stage, a.kind, a.microbatch + k * m) for k in range(steps) for a in row]
                            for row in rows], stage_rows, times)
    period = (many.makespan_ms - one.makespan_ms) / (steps - 1)
    return Periodic(one, period, tuple(1.0 - busy / period if period > 0 else 0.0 for busy in one.busy_ms))


def best_one_f_one_b_plan(num_layers: int, scale: Sequence[float], m: int, layer_f: float,
                          layer_b: float) -> tuple[float, tuple[int, ...]]:
    """The shortest 1F1B step over every contiguous split of `num_layers` into len(scale) non-empty stages
    (exhaustive: C(n - 1, p - 1) splits), and that split; ties to the first found."""
    best: Optional[tuple[float, tuple[int, ...]]] = None
    for cuts in itertools.combinations(range(1, num_layers), len(scale) - 1):
        layers = tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_layers)))
        ms = one_f_one_b_step(layers, scale, m, layer_f, layer_b)
        if best is None or ms < best[0]:
            best = (ms, layers)
    assert best is not None
    return best
