"""A stack of Linear+ReLU layers: the simplest model whose per-layer cost is controlled by its widths."""
from __future__ import annotations

from torch import nn


class StackedMLP(nn.Sequential):
    """`depth` hidden Linear(width, width)+ReLU blocks between an input and an output projection."""

    def __init__(self, in_features: int = 64, width: int = 256, depth: int = 8, num_classes: int = 10) -> None:
        layers: list[nn.Module] = [nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
