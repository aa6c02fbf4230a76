"""Per node, the bytes autograd saves for backward in a training forward (`Node.saved_bytes`).

One forward of the traced model runs with autograd on (under the profile's autocast) inside a
`saved_tensors_hooks` pack hook that returns each tensor unchanged and charges its bytes:

- to the node that *produced* the storage it views (a graph value: ReLU's result saved by ReLU and by
  the next Linear is ReLU's, once), or, for a storage no node has returned yet (an operator's
  internals, its result saved before it returns), to the node running;
- each storage once per step: the union of the byte ranges its saved views cover (graph/saved.py, the
  rule the runtime's StashMeter measures with);
- never parameters or buffers (held anyway, counted as weights), nor a model input (the step's data:
  the runtime does not count it either); a view node saves nothing new, its storage is its input's.

So a stage's stash is the sum of its nodes' `saved_bytes`, plus the boundary tensors the runtime keeps
(optimizer/memory.py). What the loss saves beyond the model's outputs is returned apart (`loss`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from model_parallel.graph.saved import countable, covered, span
from model_parallel.profiler.timing import tensors_in
from model_parallel.profiler.trace import run_preserving_state

LOSS = "loss"


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward per graph node (nodes that save nothing: 0), and by the loss."""

    nodes: dict[str, int]
    loss: int


class _Ledger:
    """Storage pointer -> the node it is charged to, and the byte ranges saved from it."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.producer: dict[int, str] = {}
        self.ranges: dict[int, list[tuple[int, int]]] = {}
        self.current = LOSS

    def produced(self, name: str, value: Any) -> None:
        for tensor in tensors_in(value):
            if countable(tensor):  # a view keeps its storage's first producer: it saves nothing new
                self.producer.setdefault(tensor.untyped_storage().data_ptr(), name)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if countable(tensor):
            pointer, start, end = span(tensor)
            if pointer not in self.excluded and end > start:
                self.producer.setdefault(pointer, self.current)
                self.ranges.setdefault(pointer, []).append((start, end))
        return tensor

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pointer, ranges in self.ranges.items():
            owner = self.producer[pointer]
            out[owner] = out.get(owner, 0) + covered(ranges)
        return out


class _SavingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, ledger: _Ledger) -> None:
        # Every value lives to the end of the pass: a freed storage's address, reused, would be charged
        # to the node that produced the dead one.
        super().__init__(gm, garbage_collect_values=False)
        self.ledger = ledger

    def run_node(self, n: fx.Node) -> Any:
        self.ledger.current = n.name
        result = super().run_node(n)
        if n.op == "placeholder":  # the step's data: never charged (the runtime excludes it too)
            self.ledger.excluded |= {t.untyped_storage().data_ptr() for t in tensors_in(result) if countable(t)}
        else:
            self.ledger.produced(n.name, result)
        return result


def record_saved_bytes(gm: fx.GraphModule, inputs: Sequence[Any], loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                       wrap_output: Callable[[Any], Any] = lambda out: out,
                       autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> SavedBytes:
    """One training forward of `gm` on `inputs` (and `loss_fn` on `wrap_output(output)`, outside
    `autocast()` as in the runtime), counting what autograd saves per node. Runs no backward."""
    excluded = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers()) if countable(t)}
    ledger = _Ledger(excluded)

    def forward_and_loss() -> None:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(ledger.pack, _unpack):
            with autocast():
                output = _SavingInterpreter(gm, ledger).run(*inputs)
            ledger.current = LOSS
            if loss_fn is not None:
                loss_fn(wrap_output(output))

    run_preserving_state(gm, forward_and_loss)  # a training forward updates BatchNorm's statistics: put back
    totals = ledger.totals()
    loss = totals.pop(LOSS, 0)
    nodes = {n.name: totals.get(n.name, 0) for n in gm.graph.nodes if n.op not in ("output",)}
    return SavedBytes(nodes, loss)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
