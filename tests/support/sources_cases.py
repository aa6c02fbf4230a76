"""The data adapters of tests/test_data_sources.py and tests/test_data_resume.py: the same samples as a map-style
Dataset, an IterableDataset, three DataLoaders, and token sequences with a dict collate for a Hugging Face GPT-2."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

N, FEATURES, CLASSES, BATCH = 40, 16, 4, 8  # 5 steps per epoch
SEQ, VOCAB = 8, 64  # the tiny GPT-2 of support.hf_zoo


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, FEATURES, generator=gen), torch.randint(0, CLASSES, (N,), generator=gen)


class Stream(IterableDataset):
    """An iterable dataset that yields the same samples on every pass."""

    def __iter__(self):
        x, y = tensors()
        return iter(zip(x, y))


def sources() -> dict[str, Any]:
    """Fresh adapters' inputs by name (a DataLoader keeps iteration state: build new ones per use)."""
    x, y = tensors()
    dataset = TensorDataset(x, y)
    return {
        "dataset": dataset,
        "iterable": Stream(),
        "loader_shuffled": DataLoader(dataset, batch_size=BATCH, shuffle=True),
        "loader_sequential": DataLoader(dataset, batch_size=BATCH),
        "loader_iterable": DataLoader(Stream(), batch_size=BATCH),
    }


def token_sequences() -> TensorDataset:
    """N sequences of SEQ + 1 token ids: a language-model dataset."""
    return TensorDataset(torch.randint(0, VOCAB, (N, SEQ + 1), generator=torch.Generator().manual_seed(1)))


def lm_collate(samples: list) -> dict[str, torch.Tensor]:
    """A dict batch: `input_ids` and their next-token targets as `labels` (already shifted: the cases train it with
    `lm_loss` given as the criterion, which receives labels as they are; see tests/integration/test_hf_labels.py)."""
    ids = torch.stack([s[0] for s in samples])
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
