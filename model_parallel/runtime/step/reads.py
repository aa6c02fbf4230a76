"""What a rank reads of one minibatch: stage 0 its microbatches' inputs, the last stage their targets (the same
step, split by the same rule: target j is microbatch j's, on whichever replica runs j), an intermediate stage or
a spare nothing. The two ends read the same step on their own (no target travels between stages)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from model_parallel.runtime.data.batches import minibatch_parts, split_targets, stage_zero_inputs
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import read_targets
from model_parallel.runtime.step.executor import NO_DATA, StepData


class StepReader:
    """A rank's reads of its data sources, on `device`; `graph_inputs` (`graph.metadata["inputs"]`) orders a dict
    of keyword inputs as the graph's placeholders."""

    def __init__(self, device: torch.device, graph_inputs: Sequence[Any], num_microbatches: int) -> None:
        self.device, self.graph_inputs, self.num_microbatches = device, graph_inputs, num_microbatches
        self.verified: set[int] = set()  # ids of the sources whose targets(step) the last stage checked

    def read(self, data: Any, step: int, first: bool, last: bool) -> StepData:
        """Minibatch `step` of `data` for a rank holding stage 0 (`first`), the last stage (`last`), both or neither."""
        m = self.num_microbatches
        if first:
            # A dict of keyword inputs (Hugging Face) is moved key by key and fed in the graph's placeholder order.
            inputs, target = tree_map(self._move, data.batch(step))
            parts = minibatch_parts(inputs, target, m, f"minibatch {step}")
            return StepData([stage_zero_inputs(self.graph_inputs, inputs, mb, f"minibatch {step}") for mb, _ in parts],
                            [t for _, t in parts] if last else None)
        if last:
            # A source's own targets(step) is checked against batch(step) on its first read (a Prefetcher checks its own).
            verify = id(data) not in self.verified and not isinstance(data, Prefetcher)
            self.verified.add(id(data))
            return StepData(targets=split_targets(tree_map(self._move, read_targets(data, step, verify)), m))
        return NO_DATA

    def _move(self, value: Any) -> Any:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value
