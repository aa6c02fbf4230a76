"""What a rank reads of one minibatch: stage 0 its microbatches' inputs, the last stage their targets (the same
step, split by the same rule: target j is microbatch j's, on whichever replica runs j), an intermediate stage or
a spare nothing. The two ends read the same step on their own (no target travels between stages)."""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from model_parallel.runtime.data.batches import minibatch_parts, split_targets, stage_zero_inputs
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import read_targets
from model_parallel.runtime.step.executor import NO_DATA, StepData

logger = logging.getLogger(__name__)


class StepReader:
    """A rank's reads of its data sources, on `device`; `graph_inputs` (`graph.metadata["inputs"]`) orders a dict
    of keyword inputs as the graph's placeholders."""

    def __init__(self, device: torch.device, graph_inputs: Sequence[Any], num_microbatches: int,
                 fixed_sizes: bool = False) -> None:
        self.device, self.graph_inputs, self.num_microbatches = device, graph_inputs, num_microbatches
        self.verified: set[int] = set()  # ids of the sources whose targets(step) the last stage checked
        self.fixed_sizes = fixed_sizes  # a torch.export trace: its stages may hold the traced sizes (view(4, 16, 64))
        self.warned: set[tuple[Any, ...]] = set()  # the input shapes already warned about

    def read(self, data: Any, step: int, first: bool, last: bool) -> StepData:
        """Minibatch `step` of `data` for a rank holding stage 0 (`first`), the last stage (`last`), both or neither."""
        m = self.num_microbatches
        if first:
            # A dict of keyword inputs (Hugging Face) is moved key by key and fed in the graph's placeholder order.
            inputs, target = tree_map(self._move, data.batch(step))
            parts = minibatch_parts(inputs, target, m, f"minibatch {step}")
            microbatches = [stage_zero_inputs(self.graph_inputs, inputs, mb, f"minibatch {step}") for mb, _ in parts]
            if self.fixed_sizes:
                self._warn_other_sizes(microbatches[0], step)
            return StepData(microbatches, [t for _, t in parts] if last else None)
        if last:
            # A source's own targets(step) is checked against batch(step) on its first read (a Prefetcher checks its own).
            verify = id(data) not in self.verified and not isinstance(data, Prefetcher)
            self.verified.add(id(data))
            return StepData(targets=split_targets(tree_map(self._move, read_targets(data, step, verify)), m))
        return NO_DATA

    def _warn_other_sizes(self, values: Sequence[Any], step: int) -> None:
        """Say so once when an input's sizes past the batch dimension are not the traced ones: a stage that holds the
        traced sizes then fails with a bare shape error ("The size of tensor a (15) must match the size of tensor b
        (16)"), as with a collate_fn that pads each batch to its longest sample. Only said, not refused: a trace that
        keeps no size (a convolutional net at another image size) runs."""
        for record, value in zip(self.graph_inputs, values):
            traced = record.get("shape") if isinstance(record, Mapping) else None
            if not isinstance(value, torch.Tensor) or not isinstance(traced, list) or list(value.shape[1:]) == traced[1:]:
                continue
            key = (record.get("name"), tuple(value.shape[1:]))
            if key in self.warned:
                continue
            self.warned.add(key)
            logger.warning("minibatch %d: input %r has sizes %s past the batch dimension where the model was traced "
                           "(torch.export) at %s; an export trace may keep the traced sizes, and a stage then fails "
                           "with a shape error: pad every batch to the traced size (e.g. DataCollatorWithPadding("
                           "tokenizer, padding='max_length', max_length=N)), or profile at the size the data has",
                           step, record.get("name"), list(value.shape[1:]), traced[1:])

    def _move(self, value: Any) -> Any:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value
