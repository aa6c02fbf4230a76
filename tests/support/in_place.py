"""A layer that scales its input in place (shared by the profiler tests of in-place operators)."""
from __future__ import annotations

import torch
from torch import nn


class InPlaceScale(nn.Module):
    """Scales its input in place: on a leaf that requires grad that fails, so the profilers run it on a clone;
    mid-step (on a value autograd made) it does not."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.weight)
