"""What autograd keeps for backward, in bytes: the one counting rule the profiler and the runtime share.

A saved tensor is charged the bytes of its storage that it views (`span`): a microbatch that is a slice
of the minibatch counts its slice, not the whole storage. Several saved tensors viewing one storage
(ReLU's result, saved by ReLU and again as the next Linear's input) count the union of their byte
ranges once (`covered`). The profiler (`profiler/saved.py`) records per node what a training forward
saves; the runtime's `StashMeter` (`runtime/observe/memory_probe.py`) measures what a stage keeps per microbatch
in flight; both count with these two functions, so a prediction and a measurement differ only by what
was saved, never by how it was counted.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(storage pointer, first byte, end byte) of the storage bytes `tensor` views."""
    pointer = tensor.untyped_storage().data_ptr()
    size = tensor.element_size()
    # int(): the stubs allow a SymInt (symbolic shapes); a tensor with a real storage pointer has plain ints.
    start = int(tensor.storage_offset()) * size
    if tensor.numel() == 0:
        return pointer, start, start
    extent = 1 + sum((int(n) - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
    return pointer, start, start + extent * size


def covered(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes of the union of [start, end) byte ranges of one storage."""
    total, reach = 0, -1
    for start, end in sorted(ranges):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def countable(tensor: object) -> bool:
    """Whether a saved value holds bytes of its own: a tensor with real storage (not meta, not a null pointer)."""
    return (isinstance(tensor, torch.Tensor) and tensor.device.type != "meta"
            and tensor.untyped_storage().data_ptr() != 0)
