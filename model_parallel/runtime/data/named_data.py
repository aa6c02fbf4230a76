"""Synthetic minibatches for a model of several named inputs (`input_ids` + `attention_mask`, ...), keyed
by (seed, step) like `runtime.data.batches.SyntheticData`, so a graph profiled with keyword inputs trains from the
command line: every input the graph records gets a value of its dtype and per-sample shape."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from model_parallel.errors import DataError
from model_parallel.runtime.data.batches import _generator

_ONES = ("attention_mask", "decoder_attention_mask", "pixel_mask")  # a mask of ones: no padding
_ZEROS = ("token_type_ids",)


@dataclass(frozen=True)
class NamedSyntheticData:
    """`batch(step) -> ({name: tensor}, target)`; `inputs` is `graph.metadata["inputs"]` (name, shape, dtype).
    Integer inputs are ids below `num_classes` (masks are ones, token types zeros), floating ones normal
    noise; the target is ids of the first input's shape for `kind` "tokens", else one class per sample."""

    batch_size: int
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    num_classes: int
    kind: str = "tokens"
    seed: int = 0

    @classmethod
    def from_graph_inputs(cls, records: Sequence[Mapping[str, Any]], batch_size: int, num_classes: int, kind: str,
                          seed: int) -> "NamedSyntheticData":
        try:
            inputs = tuple((str(r["name"]), tuple(int(d) for d in r["shape"][1:]), str(r["dtype"])) for r in records)
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"the graph's input records lack a name, shape or dtype ({error}); re-profile the model") from None
        return cls(batch_size, inputs, num_classes, kind, seed)

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        gen = _generator(self.seed, step)
        out: dict[str, torch.Tensor] = {}
        for name, shape, dtype_name in self.inputs:
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise DataError(f"graph input {name!r} has dtype {dtype_name!r}, which torch does not know")
            size = (self.batch_size, *shape)
            if dtype.is_floating_point:
                out[name] = torch.randn(size, generator=gen).to(dtype)
            elif name in _ONES or dtype == torch.bool:
                out[name] = torch.ones(size, dtype=dtype)
            elif name in _ZEROS:
                out[name] = torch.zeros(size, dtype=dtype)
            else:
                out[name] = torch.randint(self.num_classes, size, generator=gen, dtype=dtype)
        first = self.inputs[0][1]
        target_shape = (self.batch_size, *first) if self.kind == "tokens" else (self.batch_size,)
        return out, torch.randint(self.num_classes, target_shape, generator=gen)
