"""The model of tests/integration/test_dropout_masks.py: a tiny Hugging Face GPT-2 with its default dropout (0.1 on
embeddings, attention and residuals), the same in every process."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_parallel.runtime.config import TrainConfig

STEPS = 3
SCHEDULES = ("1f1b", "zbv")


def build() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                                                n_positions=16, bos_token_id=0, eos_token_id=0))


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def config(schedule: str) -> TrainConfig:
    return TrainConfig(batch_size=8, num_microbatches=4, schedule=schedule, seed=5)


class Tokens:
    batch_size = 8

    def batch(self, step: int) -> dict[str, Any]:
        ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}
