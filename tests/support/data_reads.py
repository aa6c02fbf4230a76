"""The job of tests/integration/test_data_reads.py, shared by the test and its worker (support/data_reads_worker.py)."""
from __future__ import annotations

import torch

from model_parallel.runtime.config import TrainConfig

BATCH, STEPS, EVAL_STEPS = 8, 3, 2
CONFIG = TrainConfig(batch_size=BATCH, num_microbatches=4)
EVAL_SEED = 7  # validation data of its own


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)
