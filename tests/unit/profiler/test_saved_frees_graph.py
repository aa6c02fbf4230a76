"""Counting saved bytes runs a forward with no backward: its pack hook must not keep that forward's graph alive
(a saved output packed as itself refers back to its own node, a cycle gc cannot see)."""
from __future__ import annotations

import gc

import torch
from torch import fx, nn

from model_parallel.profiler.saved import record_saved_bytes


def _live_tensors_shaped(shape: tuple[int, ...]) -> int:
    """Tensors of `shape` made since the heap was frozen: `gc.get_objects` leaves the frozen ones out, so neither it
    nor the collection walks the whole test session's heap (seconds late in the suite)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and tuple(o.shape) == shape)


def test_record_saved_bytes_leaves_no_saved_output_alive() -> None:
    torch.manual_seed(0)
    gc.freeze()
    try:
        gm = fx.symbolic_trace(nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 4)))  # Tanh saves its output
        before = _live_tensors_shaped((5, 48))
        saved = record_saved_bytes(gm, [torch.randn(5, 8)], loss_fn=lambda out: out.exp().sum())
        assert saved.nodes["_1"] == 5 * 48 * 4  # counted: Tanh's output
        assert _live_tensors_shaped((5, 48)) == before  # and gone with the forward
    finally:
        gc.unfreeze()
