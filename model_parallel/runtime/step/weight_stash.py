"""PipeDream's weight stashing (the `pipedream` schedule, no flush): a forward's weight version, kept for its backward."""
from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from model_parallel.runtime.step.update import apply_update

__all__ = ["WeightStash"]


class WeightStash:
    """PipeDream weight stashing: each forward runs on a copy of the weights of that moment, and its
    backward's gradient (computed on that copy) updates the live weights at once."""

    def __init__(self, stage: nn.Module, optimizer: torch.optim.Optimizer, lr_schedule: str, metrics: Any,
                 history: int) -> None:
        self.stage, self.optimizer, self.lr_schedule, self.metrics = stage, optimizer, lr_schedule, metrics
        self.updates = 0  # one per microbatch
        self.versions: deque[int] = deque(maxlen=history)  # `updates` at each forward: its stashed version

    def stash(self) -> dict[str, torch.Tensor]:
        self.versions.append(self.updates)
        return {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in self.stage.named_parameters()}

    def update(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        with self.metrics.measure("optimizer"):
            for name, p in self.stage.named_parameters():
                p.grad = weights[name].grad
            apply_update(self.optimizer, step, lr_schedule=self.lr_schedule)
        self.updates += 1
