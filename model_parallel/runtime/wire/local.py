"""Messages between two stages held by one rank (ZBV's V: stage p-1 hands to stage p on rank p-1): no send.

The sender `put`s a message's flat values under its (tag, stream); the receiver `take`s them when its action
runs. The schedule row runs the sender's action first (the rules place every action after what it needs),
so a missing message is a bug in the order, never a wait: `take` raises at once. Each tensor arrives as a
message would: a copy, a fresh leaf, float ones with the sender's requires_grad (packed.received), so the
receiving stage's autograd graph starts at its inputs exactly as it does across ranks. Under bf16 a wider
floating-point tensor is rounded to the wire dtype and back (`structure.narrowed`), as comm.send_values narrows
it and the receiver widens it: the stage after the hand-off computes on the value a message would carry.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from model_parallel.errors import ModelParallelError
from model_parallel.runtime.wire.structure import narrowed


def _received(value: Any, wire_dtype: Optional[torch.dtype]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if narrowed(value, wire_dtype):  # bf16: the rounding a message applies (narrowed on send, widened on arrival)
        copy = value.detach().to(wire_dtype).to(value.dtype)
    else:
        copy = value.detach().clone()
    return copy.requires_grad_(value.requires_grad) if copy.is_floating_point() else copy


class Mailbox:
    """One rank's messages between its own stages, by (tag, stream); `wire_dtype` as comm.send_values takes it."""

    def __init__(self, rank: int, wire_dtype: Optional[torch.dtype] = None) -> None:
        self.rank, self.wire_dtype = rank, wire_dtype
        self._boxes: dict[tuple[int, Any], tuple[list[Any], Any]] = {}

    def put(self, tag: int, stream: Any, values: list[Any], structure: Any = None) -> None:
        if (tag, stream) in self._boxes:
            raise ModelParallelError(f"rank {self.rank}: a second message under tag {tag}, stream {stream!r} before the "
                                     "first was taken; the schedule row sends twice")
        self._boxes[(tag, stream)] = ([_received(v, self.wire_dtype) for v in values], structure)

    def take(self, tag: int, stream: Any) -> tuple[list[Any], Any]:
        try:
            return self._boxes.pop((tag, stream))
        except KeyError:
            raise ModelParallelError(f"rank {self.rank}: no message under tag {tag}, stream {stream!r} between its own "
                                     "stages; the schedule row takes it before the sending action ran") from None


class LocalRecv:
    """A receive from a stage of the same rank, shaped like comm.PendingRecv (`wait`, then `structure`)."""

    def __init__(self, mailbox: Mailbox, tag: int, stream: Any) -> None:
        self.mailbox, self.tag, self.stream = mailbox, tag, stream
        self.structure: Optional[Any] = None

    def wait(self, timeout: float) -> list[Any]:
        values, self.structure = self.mailbox.take(self.tag, self.stream)
        return values
