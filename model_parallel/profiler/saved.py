"""Per node, the bytes autograd saves for backward in a training forward (`Node.saved_bytes`).

One forward of the traced model runs with autograd on (under the profile's autocast) inside a
`saved_tensors_hooks` pack hook that keeps a detached view of each tensor (`_unpack` says why) and charges its bytes:

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
import weakref

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

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
        return tensor.detach()  # not the tensor itself: a saved output would keep its graph alive (_unpack)

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
            # The interpreter (its values) lives through the loss too: a value freed before the loss runs would
            # lend its address to what the loss saves, which would then be charged to that value's node.
            interpreter = _SavingInterpreter(gm, ledger)
            with autocast():
                output = interpreter.run(*inputs)
            ledger.current = LOSS
            if loss_fn is not None:
                loss_fn(wrap_output(output))

    run_preserving_state(gm, forward_and_loss)  # a training forward updates BatchNorm's statistics: put back
    totals = ledger.totals()
    loss = totals.pop(LOSS, 0)
    nodes = {n.name: totals.get(n.name, 0) for n in gm.graph.nodes if n.op not in ("output",)}
    return SavedBytes(nodes, loss)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    # The packs keep a detached view (same storage): an operator's saved output packed as itself refers back to
    # the node saving it (tensor -> grad_fn -> saved tensor), a cycle through C++ that gc cannot see and only a
    # backward without retain_graph breaks; these forwards run no backward, so each graph leaked.
    return tensor


class NodeByNodeSaving(fx.Interpreter):
    """The same count for a layer-by-layer profile (`profiler.layer_by_layer.LayerWalk`), one node at a time.

    A whole-model forward with autograd would keep every node's materialized parameters alive (its autograd
    graph references them) and defeat the walk's memory bound. So each node runs on detached copies of its
    inputs carrying their `requires_grad` (what decides what autograd saves), what it saves is charged by the
    rule above, and its output goes on detached: only live activations stay. A storage is known by its pointer
    only while a value viewing it lives (a freed address, reused, belongs to whoever allocates it next), and its
    ranges are keyed by (node charged, pointer). Wrap it with `LayerWalk.interpreter` to materialize each node.
    """

    def __init__(self, gm: fx.GraphModule, autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        super().__init__(gm)  # values are freed after their last use: the walk's live activations only
        self.autocast = autocast
        self.owner: dict[int, Optional[str]] = {}  # live storage pointer -> the node charged (None: never charged)
        self.views: dict[int, int] = {}  # live storage pointer -> live values viewing it
        self.alias: dict[int, tuple[int, int, int]] = {}  # a live clone's storage -> the span of what it copies
        self.ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output"):  # the step's data and the weights: never charged
            result = super().run_node(n)
            self.keep(result, None)
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        held = {t.untyped_storage().data_ptr() for t in _module_tensors(self.module, n) if countable(t)}
        call = lambda inputs: getattr(self, n.op)(n.target, *inputs)  # noqa: E731
        try:
            result = self.saving(n.name, held, lambda: call(_detached((args, kwargs))))
        except RuntimeError as error:
            if "in-place" not in str(error):
                raise
            # An in-place operator on an input that requires grad fails on a leaf, mid-step it does not: it
            # runs on a clone then (as the in-situ segments do), whose storage is charged as the input's.
            alias: dict[int, tuple[int, int, int]] = {}
            cloned = _detached((args, kwargs), alias)
            result = self.saving(n.name, held, lambda: call(cloned), alias)
            # An output in a clone's storage (the in-place result) is the input's value, charged as the input.
            for clone in {t.untyped_storage().data_ptr() for t in tensors_in(result)} & set(alias):
                self.alias[clone], self.owner[clone] = alias[clone], self.owner.get(alias[clone][0])
        result = _detached(result)
        self.keep(result, n.name, held)
        return result

    def saving(self, name: str, held: set[int], run: Callable[[], Any],
               alias: Optional[dict[int, tuple[int, int, int]]] = None) -> Any:
        """`run()` under the pack hook, charging what it saves to the producer of the storage (a live value's),
        else to `name`; `held` (the node's own weights) is never charged; `alias`: a clone's storage -> the
        span of the input it copies. Counted only when `run()` returns (a failed attempt counts nothing)."""
        mine: dict[tuple[str, int], list[tuple[int, int]]] = {}
        aliases = {**self.alias, **(alias or {})}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if countable(tensor):
                raw, start, end = span(tensor)
                pointer, start, end = aliases.get(raw, (raw, start, end))
                charged = None if pointer in held else self.owner[raw] if raw in self.owner else self.owner.get(pointer, name)
                if charged is not None and end > start:
                    mine.setdefault((charged, pointer), []).append((start, end))
            return tensor.detach()  # as _Ledger.pack: no cycle keeping the node's graph (and parameters) alive

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack), self.autocast():
            result = run()
        for key, ranges in mine.items():
            self.ranges.setdefault(key, []).extend(ranges)
        return result

    def keep(self, value: Any, name: Optional[str], held: Optional[set[int]] = None) -> None:
        """The storages of a live value: a new one is `name`'s (None: never charged), a view keeps its producer."""
        for tensor in tensors_in(value):
            if not countable(tensor):
                continue
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in self.owner:
                self.owner[pointer] = None if held and pointer in held else name
            self.views[pointer] = self.views.get(pointer, 0) + 1
            weakref.finalize(tensor, self._dropped, pointer)

    def _dropped(self, pointer: int) -> None:
        self.views[pointer] -= 1
        if not self.views[pointer]:
            del self.views[pointer], self.owner[pointer]
            self.alias.pop(pointer, None)

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (owner, _), ranges in self.ranges.items():
            out[owner] = out.get(owner, 0) + covered(ranges)
        return out


def record_saved_bytes_by_node(interpreter: NodeByNodeSaving, inputs: Sequence[Any],
                               loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                               wrap_output: Callable[[Any], Any] = lambda out: out) -> SavedBytes:
    """`record_saved_bytes` for a layer-by-layer profile: `interpreter` a (walk-wrapped) `NodeByNodeSaving`.
    The loss runs on the detached output, outside the autocast, as in the runtime."""
    output = interpreter.run(*inputs)
    if loss_fn is not None:
        autocast, interpreter.autocast = interpreter.autocast, nullcontext
        interpreter.saving(LOSS, set(), lambda: loss_fn(wrap_output(output)))
        interpreter.autocast = autocast
    totals = interpreter.totals()
    loss = totals.pop(LOSS, 0)
    graph = interpreter.module.graph
    assert isinstance(graph, fx.Graph)
    return SavedBytes({n.name: totals.get(n.name, 0) for n in graph.nodes if n.op != "output"}, loss)


def _module_tensors(gm: torch.nn.Module, n: fx.Node) -> list[torch.Tensor]:
    """A call_module node's parameters and buffers (real while the walk materializes it): held, not stashed."""
    if n.op != "call_module":
        return []
    module = gm.get_submodule(str(n.target))
    return [*module.parameters(), *module.buffers()]


def _detached(value: Any, alias: Optional[dict[int, tuple[int, int, int]]] = None) -> Any:
    """`value` with every tensor detached, keeping whether it requires grad (what autograd's saving depends on);
    with `alias`, one that requires grad is a clone of such a leaf instead (not a leaf: in-place operators work
    on it), its storage recorded in `alias` as the span of the tensor it copies."""

    def one(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        out = v.detach()
        if not (v.requires_grad and (v.is_floating_point() or v.is_complex())):
            return out
        out = out.requires_grad_(True)
        if alias is None or not countable(v):
            return out
        clone = out.clone()
        alias[clone.untyped_storage().data_ptr()] = span(v)
        return clone

    return tree_map(one, value)
