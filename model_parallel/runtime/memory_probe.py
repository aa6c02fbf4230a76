"""What a stage really holds, measured: tensor storage bytes by kind, and the process's peak.

The optimizer's footprint model (`optimizer/memory.py`) predicts parameters + gradients + optimizer
state + stashed activations per stage; `state_bytes` counts the first three exactly from tensor
storages (RSS would also count the allocator's caches and the interpreter), and `PeakProbe` measures
the peak: on CUDA `torch.cuda.max_memory_allocated` since `start`, on CPU the growth of the process's
peak RSS since `start` (an upper estimate: it includes allocator slack and the stage's code).
"""
from __future__ import annotations

import resource
import sys
from typing import Any, Optional

import torch
from torch import nn


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def state_bytes(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
    """Bytes of the storages behind `module`'s parameters, their gradients and the optimizer's state
    (each storage counted once: tied parameters share one). `optimizer_state` counts the state tensors
    shaped like their parameter (momentum, Adam's moments), `optimizer_scalars` the rest (Adam's step)."""
    seen: set[int] = set()
    out = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "optimizer_scalars": 0}

    def add(kind: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            pointer, size = _storage(tensor)
            if pointer not in seen or pointer == 0:
                seen.add(pointer)
                out[kind] += size

    parameters = list(module.parameters())
    for p in parameters:
        add("parameters", p)
    for p in parameters:
        add("gradients", p.grad)
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add("optimizer_state" if value.shape == p.shape else "optimizer_scalars", value)
    return out


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PeakProbe:
    """Peak bytes since `start()`: CUDA's allocator peak on a GPU, else the growth of peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline = peak_rss_bytes()

    @property
    def source(self) -> str:
        return "cuda_max_allocated" if self.device.type == "cuda" else "peak_rss_growth"

    def peak(self) -> int:
        """Bytes above the baseline at the peak (CUDA: all allocated bytes at the peak, the stage's included)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, peak_rss_bytes() - self.baseline)
