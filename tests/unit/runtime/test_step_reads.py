"""runtime/step/reads.py: stage 0's reads say once when an input's sizes past the batch dimension are not the ones a
torch.export trace was made at (a collate_fn padding each batch to its longest sample): the stage then fails with a
bare "The size of tensor a (15) must match the size of tensor b (16)"."""
from __future__ import annotations

import torch

from model_parallel.runtime.step.reads import StepReader

TRACED = [{"name": "input_ids", "shape": [2, 16], "dtype": "int64"}]


class Padded:
    """Batches padded to their longest sample: 15 tokens at step 1, 16 otherwise."""

    def batch(self, step: int):
        length = 15 if step == 1 else 16
        return (torch.zeros(4, length, dtype=torch.long),), torch.zeros(4, length, dtype=torch.long)


def test_other_sizes_than_the_export_trace_are_named_once(caplog) -> None:
    reader = StepReader(torch.device("cpu"), TRACED, 2, fixed_sizes=True)
    with caplog.at_level("WARNING", logger="model_parallel.runtime.step.reads"):
        for step in (0, 1, 1, 2):
            reader.read(Padded(), step, first=True, last=True)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert ("minibatch 1: input 'input_ids' has sizes [15] past the batch dimension where the model was traced "
            "(torch.export) at [16]") in warnings[0]
    assert "padding='max_length'" in warnings[0]


def test_a_trace_that_keeps_no_sizes_says_nothing(caplog) -> None:
    reader = StepReader(torch.device("cpu"), TRACED, 2, fixed_sizes=False)  # fx: sizes stay symbolic
    with caplog.at_level("WARNING", logger="model_parallel.runtime.step.reads"):
        reader.read(Padded(), 1, first=True, last=True)
    assert not caplog.records
