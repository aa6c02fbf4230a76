"""Before profiling a classifier: the memory and time it will take, and the flags that make it feasible.

`resnet152 -b 64` at 224 pixels on a laptop CPU needs about 12 GB and well over ten minutes; the
profiler says so before it starts instead of going silent. Memory comes from one training step run on
the meta device (shapes only: no memory, no arithmetic), counting what autograd keeps for backward;
time from two training steps at a small batch, scaled to the requested one.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from model_parallel.profiler.timing import time_training_step, training_step

logger = logging.getLogger(__name__)

SLOW_SECONDS = 600.0  # over this, the estimate comes with the flags that make profiling quicker
PROBE_BATCH = 2  # the time probe's batch (BatchNorm needs 2 samples in training)
HEADROOM = 0.9  # the rest of the process (torch, the data, the profiler's copies) needs room too


def format_bytes(value: float) -> str:
    return f"{value / 1e9:.1f} GB" if value >= 1e9 else f"{value / 1e6:.0f} MB"


def format_seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 90:
        return f"{value:.0f} s"
    return f"{value / 60:.1f} min" if value < 5400 else f"{value / 3600:.1f} h"


@dataclass(frozen=True)
class MemoryEstimate:
    """The peak of a training step at `batch_size`: weights, their gradients, and the activations
    autograd keeps for backward (the profiler's own replays hold much less)."""

    batch_size: int
    parameter_bytes: int
    activation_bytes: int
    available_bytes: Optional[int]

    @property
    def peak_bytes(self) -> int:
        return 2 * self.parameter_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.peak_bytes <= HEADROOM * self.available_bytes

    def largest_batch(self) -> int:
        """The largest batch whose estimate fits (activations grow linearly with the batch); 0 if none."""
        if self.available_bytes is None:
            return self.batch_size
        per_sample = self.activation_bytes / self.batch_size
        room = HEADROOM * self.available_bytes - 2 * self.parameter_bytes
        return max(0, int(room // per_sample)) if per_sample > 0 else self.batch_size

    def describe(self) -> str:
        available = f" of {format_bytes(self.available_bytes)} available" if self.available_bytes is not None else ""
        return (f"peak memory about {format_bytes(self.peak_bytes)}{available} (weights and gradients "
                f"{format_bytes(2 * self.parameter_bytes)}, activations kept for backward {format_bytes(self.activation_bytes)})")

    def refusal(self, what: str, device: torch.device) -> str:
        largest = self.largest_batch()
        smaller = (f"use -b {largest} (about {format_bytes(2 * self.parameter_bytes + self.activation_bytes * largest / self.batch_size)}) "
                   "or a smaller --image-size" if largest >= 1 else "even batch 1 does not fit: use a smaller --image-size")
        return (f"{what} needs about {format_bytes(self.peak_bytes)} to profile (weights and gradients "
                f"{format_bytes(2 * self.parameter_bytes)}, activations kept for backward {format_bytes(self.activation_bytes)}) "
                f"but {format_bytes(self.available_bytes or 0)} is available on {device}; {smaller}, or --force to try anyway")


def meta_training_bytes(model: nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable[[Any], torch.Tensor]) -> tuple[int, int]:
    """(parameter bytes, bytes autograd saves for backward) of one training step of a model built on
    the meta device, run on meta `inputs`: nothing is allocated or computed."""
    parameters = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}  # by identity: one activation saved by two ops counts once

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        owner = tensor._base if tensor._base is not None else tensor
        if id(owner) not in parameters:  # weights (and their transposes) are counted as parameters
            saved[id(tensor)] = tensor
        # A detached view, not the tensor: a saved output packed as itself refers back to the node saving it, a
        # cycle through C++ that gc cannot free and no backward breaks here (runtime/observe/memory_probe.py).
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), torch.enable_grad():
        loss_fn(model(*inputs))
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    activation_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    saved.clear()  # every saved value keeps the pack hook, which keeps `saved`: a cycle through C++ otherwise
    return parameter_bytes, activation_bytes


def available_memory_bytes(device: torch.device) -> Optional[int]:
    """Free memory on `device`: CUDA's free bytes, or the kernel's MemAvailable on CPU (None if unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def step_equivalents(warmup: int, iterations: int, step_iterations: int, rounds: int) -> float:
    """Profiling's work in training steps: the warm-up step, the timed steps, and per round every node
    replayed warmup + iterations times plus two forward passes (shapes, and the run between replays)."""
    return 1 + step_iterations * (rounds + 1) + rounds * (warmup + iterations + 2 / 3)


@dataclass(frozen=True)
class TimeEstimate:
    step_s: float  # one training step at the requested batch (scaled from the probe's)
    probe_batch: int
    warmup: int
    iterations: int
    step_iterations: int
    rounds: int

    @property
    def total_s(self) -> float:
        return self.step_s * step_equivalents(self.warmup, self.iterations, self.step_iterations, self.rounds)

    def describe(self, batch_size: int) -> str:
        steps = step_equivalents(self.warmup, self.iterations, self.step_iterations, self.rounds)
        return (f"estimate: a training step takes about {format_seconds(self.step_s)} at batch {batch_size} (timed at batch "
                f"{self.probe_batch}); profiling costs about {steps:.0f} steps: {format_seconds(self.total_s)} in all")

    def advice(self, batch_size: int, image_size: int, device: torch.device, threads: int) -> list[str]:
        """Flags that shorten the run, each with its estimate."""
        options = []
        if image_size > 32:
            options.append(f"--image-size 32 (about {format_seconds(self.total_s * (32 / image_size) ** 2)})")
        if batch_size > 8:
            options.append(f"-b 8 (about {format_seconds(self.total_s * 8 / batch_size)})")
        cheap = step_equivalents(0, 1, 1, 1)
        if cheap < step_equivalents(self.warmup, self.iterations, self.step_iterations, self.rounds):
            options.append(f"--warmup 0 --iterations 1 --step-iterations 1 (about {format_seconds(self.step_s * cheap)}, noisier)")
        cores = os.cpu_count() or 1
        if device.type == "cpu" and threads < cores:
            options.append(f"--threads {cores} (torch uses {threads} of {cores} cores)")
        return options


def probe_step_seconds(model: nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
                       device: torch.device, clock: str = "wall") -> float:
    """Seconds of one training step on `inputs` (the second of two: the first pays first-touch costs)."""
    training_step(model, inputs, loss_fn)
    return time_training_step(model, inputs, loss_fn, device, 1, clock)[0] / 1000.0


def estimate_time(model: nn.Module, probe_inputs: Sequence[Any], probe_loss: Callable[[Any], torch.Tensor], probe_batch: int,
                  batch_size: int, image_size: int, device: torch.device, counts: tuple[int, int, int, int],
                  say: Callable[[str], None]) -> TimeEstimate:
    """Time a step at `probe_batch`, scale it to `batch_size`, and say what profiling will cost
    (`counts`: warmup, iterations, step_iterations, rounds); over `SLOW_SECONDS`, also what shortens it."""
    seconds = probe_step_seconds(model, probe_inputs, probe_loss, device)  # wall time: what the user waits
    timing = TimeEstimate(seconds * batch_size / probe_batch, probe_batch, *counts)
    say(timing.describe(batch_size))
    if timing.total_s > SLOW_SECONDS:
        options = timing.advice(batch_size, image_size, device, torch.get_num_threads())
        say(f"warning: profiling will take about {format_seconds(timing.total_s)} on {device}; to make it quicker: "
            + "; ".join(options) + ". Going on (Ctrl-C keeps what was measured: the same command resumes)")
    return timing
