"""The cases of tests/test_evaluate.py: a tiny Hugging Face GPT-2 and our zoo's TinyGPT and MLP, each with
training data, held-out data, a loss and a metric (token or class accuracy)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_parallel.runtime.config import TrainConfig

STEPS, EVAL_STEPS = 3, 2


def accuracy(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return (logits.argmax(-1) == target).float().mean()


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class HeldOut:
    """Another seed's minibatches of the same kind: data the model never trained on."""

    def __init__(self, data: Any, offset: int = 10_000) -> None:
        self.data, self.offset, self.batch_size = data, offset, data.batch_size

    def batch(self, step: int) -> Any:
        return self.data.batch(self.offset + step)


@dataclass
class Case:
    model: nn.Module
    train_data: Any
    eval_data: Any
    loss: Any
    example: Any
    config: TrainConfig = TrainConfig(batch_size=8, num_microbatches=4)
    metric: Any = accuracy
    sgd: Any = sgd


def case_names() -> list[str]:
    return ["gpt2", "tinygpt", "mlp"]


def make_case(name: str) -> Case:
    """The same model (seeded) and data on every call, in every process."""
    if name == "gpt2":
        from support.hf_zoo import CASES

        hf = CASES["gpt2"]
        return Case(hf.build(), hf.data, HeldOut(hf.data), hf.loss, hf.example(2))
    from model_parallel.runtime.build.zoo import recipe

    r = recipe("gpt" if name == "tinygpt" else "mlp")
    data = r.data(8, 0)
    return Case(r.model(0), data, HeldOut(data), r.criterion, r.example(2))
