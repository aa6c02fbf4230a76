"""The forms a batch takes: (inputs, target), inputs a tuple of positional inputs or a dict of keyword inputs, or one
Hugging Face dict holding the target under "labels" (causal-LM labels shifted as the model's own loss does)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from model_parallel.errors import DataError

__all__ = ["Batch", "as_pair", "shift_causal_labels", "IGNORE_INDEX", "describe", "BATCH_FORMS"]

Batch = tuple[Any, torch.Tensor]


def as_pair(batch: Any, where: str, causal_labels: bool = False) -> Batch:
    """A collated batch as (inputs, target): inputs a tuple of positional inputs or one dict of keyword inputs.
    `causal_labels`: a dict batch's "labels" are Hugging Face's causal-LM labels, shifted into next-token targets."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise DataError(f"{where}: a dict batch needs a 'labels' entry (the target), found keys {sorted(batch)}; "
                            "add it in the collate function")
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if causal_labels:
            return inputs, shift_causal_labels(batch["labels"], inputs.get("input_ids"), where)
        return inputs, batch["labels"]
    if isinstance(batch, Sequence) and len(batch) == 2:
        inputs, target = batch
        if isinstance(inputs, Mapping):
            return dict(inputs), target
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target
    raise DataError(f"{where}: a batch must be (inputs, target) or a dict with 'labels', got {type(batch).__name__}"
                    f"{f' of {len(batch)} items' if isinstance(batch, Sequence) else ''}; give a collate_fn that returns one")


IGNORE_INDEX = -100  # the label cross entropy skips (torch's default ignore_index, Hugging Face's padding label)


def shift_causal_labels(labels: torch.Tensor, input_ids: Any, where: str) -> torch.Tensor:
    """Hugging Face's causal-LM labels as next-token targets: target[t] = labels[t + 1], the last position ignored,
    exactly what the model's own loss does (transformers' ForCausalLMLoss pads with -100 and shifts). Labels that are
    already shifted (labels[t] = input_ids[t + 1]) would be shifted twice and train the token after next: refused."""
    if (isinstance(input_ids, torch.Tensor) and input_ids.shape == labels.shape and labels.shape[-1] > 1
            and _agree(labels[..., :-1], input_ids[..., 1:]) and not _agree(labels, input_ids)):
        raise DataError(f"{where}: the 'labels' are already shifted (labels[t] = input_ids[t + 1]); to a causal-LM "
                        "head a dict batch's labels are Hugging Face's, which the model's loss shifts itself, so they "
                        "would be shifted twice: give labels = input_ids (-100 where no loss), or the batch as "
                        "(inputs, next-token targets), or your own criterion")
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def _agree(labels: torch.Tensor, ids: torch.Tensor) -> bool:
    """`labels` equal `ids` wherever they score a token (not IGNORE_INDEX), and score at least one."""
    scored = labels != IGNORE_INDEX
    return bool(scored.any()) and torch.equal(labels[scored], ids[scored].to(labels.dtype))


def describe(value: Any, depth: int = 0) -> str:
    """A value's types and shapes, short: `tuple(Tensor(8, 16) float32, Tensor(8,) int64)` (error messages)."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if depth >= 2 or not isinstance(value, (Mapping, tuple, list)) or len(value) > 8:
        return type(value).__name__ + (f" of {len(value)} items" if isinstance(value, (Mapping, tuple, list)) else "")
    if isinstance(value, Mapping):
        return "dict(" + ", ".join(f"{k!r}: {describe(v, depth + 1)}" for k, v in value.items()) + ")"
    return f"{type(value).__name__}(" + ", ".join(describe(v, depth + 1) for v in value) + ")"


BATCH_FORMS = ("batch(step) returns (inputs, target): target a tensor (dim 0 = the minibatch's samples), inputs a "
               "tensor (the model's one input), a tuple or list of tensors (its positional inputs, e.g. ((x,), y) or "
               "((x, mask), y)) or a dict of keyword inputs (({'input_ids': x}, y)); or one dict of keyword inputs "
               "holding the target under 'labels' ({'input_ids': x, 'labels': y})")
