"""Built-in models the worker command line can train by name (`--model mlp|resnet18|gpt`).

Each recipe builds the model (on meta for a job, see runtime/build/materialize.py; with values by the
per-layer init rule for a reference), the loss, an example input for tracing and a synthetic
dataset of matching shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.errors import ModelParallelError
from model_parallel.runtime.data.batches import SyntheticData


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable[[], nn.Module]
    criterion: Callable[[Any, torch.Tensor], torch.Tensor]
    input_shape: tuple[int, ...]  # per sample
    num_classes: int
    kind: str = "dense"  # "dense" float inputs or "tokens"

    def model(self, seed: int) -> nn.Module:
        """The model with the values every pipeline run of this seed gives it (the per-layer init rule)."""
        from model_parallel.runtime.build.materialize import materialize_model

        return materialize_model(self.meta_model(), seed)

    def meta_model(self) -> nn.Module:
        """The model on the meta device: shapes only, no memory (each rank materializes its own layers)."""
        with torch.device("meta"):
            return self.build()

    def example(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        return SyntheticData(batch_size, self.input_shape, self.num_classes, self.kind).batch(0)[0]

    def data(self, batch_size: int, seed: int) -> SyntheticData:
        return SyntheticData(batch_size, self.input_shape, self.num_classes, self.kind, seed)


def _mlp() -> nn.Module:
    from model_parallel.models import StackedMLP

    return StackedMLP(in_features=64, width=128, depth=6, num_classes=10)


def _resnet18() -> nn.Module:
    from model_parallel.compat import import_torchvision

    return import_torchvision().models.resnet18(num_classes=10)


def _gpt() -> nn.Module:
    from model_parallel.models import TinyGPT

    return TinyGPT(vocab_size=128, seq_len=16, dim=32, num_heads=2, num_layers=3)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from model_parallel.models.gpt import lm_loss

    return lm_loss(logits, targets)


RECIPES = {
    "mlp": Recipe("mlp", _mlp, F.cross_entropy, (64,), 10),
    "resnet18": Recipe("resnet18", _resnet18, F.cross_entropy, (3, 32, 32), 10),
    "gpt": Recipe("gpt", _gpt, _lm_loss, (16,), 128, kind="tokens"),
}


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ModelParallelError(f"unknown model {name!r}; built-in models: {', '.join(sorted(RECIPES))}") from None
