"""The cases of tests/test_data_resume.py: each data adapter with a small MLP, and a Hugging Face GPT-2 fed by a
map-style dataset of token sequences through a dict collate (`input_ids`, `labels`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.models.mlp import StackedMLP
from model_parallel.runtime.config import TrainConfig
from support.sources_cases import BATCH, CLASSES, FEATURES, lm_collate, sources, token_sequences

STEPS, CUT = 9, 7  # 5 steps per epoch: the checkpoint's next step 7 is minibatch 2 of epoch 1


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@dataclass
class Case:
    model: nn.Module
    data: Any
    loss: Any
    example: Any
    collate: Optional[Any] = None
    config: TrainConfig = TrainConfig(batch_size=BATCH, num_microbatches=2, seed=5)
    sgd: Any = sgd


def case_names() -> list[str]:
    return sorted(sources()) + ["gpt2_collate"]


def make_case(name: str) -> Case:
    """The same seeded model and fresh data on every call, in every process."""
    if name == "gpt2_collate":
        from support.hf_zoo import CASES, lm_loss

        ids = lm_collate([token_sequences()[i] for i in range(BATCH // 2)])["input_ids"]
        return Case(CASES["gpt2"].build(), token_sequences(), lm_loss, {"input_ids": ids}, collate=lm_collate)
    torch.manual_seed(1)
    return Case(StackedMLP(FEATURES, 32, 2, CLASSES), sources()[name], F.cross_entropy, None)
