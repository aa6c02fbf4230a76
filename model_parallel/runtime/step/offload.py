"""Optimizer state on local disk (ZeRO-Offload's "offload_optimizer: nvme" for one rank): a chunked optimizer step.

A rank's optimizer keeps its per-parameter state tensors (AdamW's exp_avg/exp_avg_sq, SGD's momentum_buffer) in
flat files under `<dir>/rank<N>/`; scalars such as Adam's `step` stay in memory. `OptimizerOffload.step` runs the
user's optimizer once per chunk of parameters: each param group's `params` list is swapped for the chunk's members
(every hyperparameter, and the lr the schedule set, stays in the group), the chunk's state is read from disk into
fresh tensors, `optimizer.step()`, the state is written back and dropped. At most `chunk_bytes` of state is in memory
at once, the first step (where the optimizer creates its state) included:

    pieces   p0 | p1 | p2[0:k] | p2[k:] | p3 ...      (a parameter whose state exceeds the chunk is cut in slices)
    chunks   [p0 p1] [p2[0:k]] [p2[k:] p3] ...         (greedy, each <= chunk_bytes of state)

Slicing is exact only for optimizers whose update is elementwise (`SLICEABLE`: SGD, Adam, AdamW, whose state bytes
per parameter byte are known); any other optimizer steps a parameter whole, so one parameter's state may exceed the
chunk, and its state ratio is measured on its first chunk (one parameter). Files are read and written with
`readinto`/`write` of the tensor's own bytes, never memory-mapped (a map would only move the bytes out of the memory
a cap counts) and never unpickled. They are scratch, not a checkpoint: rewritten every step, removed with the
optimizer; checkpoints and a plan switch's kept layers copy the state file to file (`ranges`: FileRanges over the
piece files, runtime/step/file_range.py), restores write it through `load` (from tensors, or file to file from a
shard's records), a moving layer's state is read through `read_param` (runtime/checkpoint/state.py). The optimizer's
own step hooks run once per chunk.
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from model_parallel.allocator import mapped_empty
from model_parallel.errors import ConfigError
from model_parallel.runtime.step.file_range import FileRange

SLICEABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # exact types: per-element updates
_OFFLOADS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerOffload]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened parameter `index` (over all groups, in order) of group `group`."""

    group: int
    index: int
    start: int
    stop: int

    @property
    def key(self) -> str:
        return f"p{self.index}_{self.start}"


def _state_ratio(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Optional[float]:
    """State bytes per parameter byte of a group, where the optimizer's type says (None: measure it)."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return 3.0 if group.get("amsgrad") else 2.0
    if type(optimizer) is torch.optim.SGD:
        return 1.0 if group.get("momentum") else 0.0
    return None


class OptimizerOffload:
    """The on-disk state of one optimizer and its chunked step (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, directory: Union[str, Path], chunk_bytes: int) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ConfigError("--offload_optimizer cannot step LBFGS in chunks (its step re-evaluates the whole model "
                              "through a closure); use another optimizer or leave --offload_optimizer off")
        if chunk_bytes < 1:
            raise ConfigError(f"offload chunk must be >= 1 byte, got {chunk_bytes}; give --offload_chunk_mb > 0")
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        # A directory of its own: a plan switch builds the next optimizer beside the running one.
        self.directory = Path(tempfile.mkdtemp(prefix="optimizer-", dir=root))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.chunk_bytes = int(chunk_bytes)
        self.sliceable = type(optimizer) in SLICEABLE
        self.ratio: dict[int, Optional[float]] = {g: _state_ratio(optimizer, group)
                                                  for g, group in enumerate(optimizer.param_groups)}
        self.files: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}  # piece key -> state key -> meta
        self.scalars: dict[str, dict[str, Any]] = {}  # piece key -> what stays in memory (Adam's step)
        self.peak_state_bytes = 0  # the most state bytes one chunk held (tests and the memory table read it)
        if optimizer.state:  # state the factory or a restore installed: onto disk before anything steps
            self._absorb(optimizer)

    # ---- the chunked step -------------------------------------------------------------------------------------
    def pieces(self, optimizer: torch.optim.Optimizer) -> list[Piece]:
        """Every parameter of every group, cut in slices of at most a chunk's state where the optimizer allows."""
        out: list[Piece] = []
        index = 0
        for g, group in enumerate(optimizer.param_groups):
            if g not in self.ratio:  # a group added after `attach` (Optimizer.add_param_group)
                self.ratio[g] = _state_ratio(optimizer, group)
            ratio = self.ratio[g]
            for p in group["params"]:
                n = p.numel()
                per = ratio * p.element_size() if ratio else 0.0
                step = max(1, int(self.chunk_bytes // per)) if per and self.sliceable and p.is_contiguous() else n
                out.extend(Piece(g, index, a, min(n, a + step)) for a in range(0, max(n, 1), step))
                index += 1
        return out

    def next_chunk(self, todo: list[Piece], params: list[torch.Tensor]) -> list[Piece]:
        """Pop the next chunk off `todo`: pieces packed greedily up to `chunk_bytes` of state (a piece too big, or
        of a group whose state ratio is not known yet, stands alone: its step measures the ratio, `_store`)."""
        chunk: list[Piece] = []
        held = 0.0
        while todo:
            piece = todo[0]
            ratio = self.ratio[piece.group]
            size = (piece.stop - piece.start) * params[piece.index].element_size() * (ratio if ratio is not None else 0.0)
            if chunk and (ratio is None or held + size > self.chunk_bytes):
                break
            chunk.append(todo.pop(0))
            held += size
            if ratio is None:
                break
        return chunk

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()` over every chunk in turn, its state read from and written back to disk."""
        groups = optimizer.param_groups
        saved = [group["params"] for group in groups]
        params = [p for ps in saved for p in ps]
        try:
            # A parameter without a gradient is skipped by the optimizer: no state is read, created or written.
            todo = [piece for piece in self.pieces(optimizer) if params[piece.index].grad is not None]
            while todo:
                chunk = self.next_chunk(todo, params)
                views = [self._view(params[piece.index], piece) for piece in chunk]
                for piece, view in zip(chunk, views):
                    optimizer.state[view] = self._read(piece.key, view.device)
                for g, group in enumerate(groups):
                    group["params"] = [v for piece, v in zip(chunk, views) if piece.group == g]
                optimizer.step()
                held = sum(self._store(piece, optimizer.state.pop(view, {}), params[piece.index])
                           for piece, view in zip(chunk, views))
                self.peak_state_bytes = max(self.peak_state_bytes, held)
        finally:
            for group, ps in zip(groups, saved):
                group["params"] = ps
            for p in params:
                optimizer.state.pop(p, None)  # nothing of the state stays behind in memory

    # ---- whole parameters: checkpoints, plan switches, restores ---------------------------------------------------
    def state_of(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, its state as `optimizer.state[parameter]` would hold it) one parameter at a time, read from
        disk (slices joined); parameters without state yet are skipped, as torch's state dict skips them."""
        for param, _ in self.state_layout(optimizer):
            yield param, self.read_param(optimizer, param)

    def state_layout(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, its state with each tensor a meta tensor of the whole parameter's shape and dtype) without
        reading a file: what a checkpoint writer lays out before it streams the bytes (`read_param`)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, pieces in sorted(self._pieces_by_param(optimizer).items()):
            first = pieces[0].key
            if first not in self.files and first not in self.scalars:
                continue
            state: dict[str, Any] = dict(self.scalars.get(first, {}))
            for name, (shape, dtype) in self.files.get(first, {}).items():
                state[name] = torch.empty(params[index].shape if len(pieces) > 1 else shape, dtype=dtype, device="meta")
            yield params[index], state

    def read_param(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
        """One parameter's whole state read from disk (its slices joined)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        index = next(i for i, p in enumerate(params) if p is param)
        pieces = self._pieces_by_param(optimizer)[index]
        parts = [self._read(piece.key, mapped=True) for piece in pieces]
        state = dict(parts[0])
        for name in self.files.get(pieces[0].key, {}):
            if len(parts) > 1:
                state[name] = torch.cat([part[name].reshape(-1) for part in parts]).view(param.shape)
        return state

    def ranges(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
        """One parameter's whole state with each tensor a FileRange over its pieces' files (nothing read): what a
        checkpoint writer or a plan switch's next optimizer copies file to file."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        index = next(i for i, p in enumerate(params) if p is param)
        pieces = self._pieces_by_param(optimizer)[index]
        state: dict[str, Any] = {name: value.clone() if isinstance(value, torch.Tensor) else value
                                 for name, value in self.scalars.get(pieces[0].key, {}).items()}
        for name, (shape, dtype) in self.files.get(pieces[0].key, {}).items():
            size = dtype.itemsize
            segments = tuple((self._path(piece.key, name), 0, (piece.stop - piece.start) * size) for piece in pieces)
            state[name] = FileRange(tuple(param.shape) if len(pieces) > 1 else shape, dtype, segments)
        return state

    def _pieces_by_param(self, optimizer: torch.optim.Optimizer) -> dict[int, list[Piece]]:
        by_param: dict[int, list[Piece]] = {}
        for piece in self.pieces(optimizer):
            by_param.setdefault(piece.index, []).append(piece)
        return by_param

    def load(self, optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Install one parameter's whole state (a restore or an arriving layer's) onto disk, cut as its pieces."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        index = next(i for i, p in enumerate(params) if p is param)
        for piece in (piece for piece in self.pieces(optimizer) if piece.index == index):
            whole = piece.start == 0 and piece.stop == param.numel()
            # Each slice its own scalars: Adam increments `step` in place, once per slice it steps. A state tensor
            # goes to the piece's file as it is (a slice of it where cut): no copy.
            part = {name: (value.detach().clone() if value.dim() == 0 else value.detach() if whole
                           else value.detach().reshape(-1)[piece.start:piece.stop])
                    if isinstance(value, torch.Tensor)
                    else (value if whole else value.elements(piece.start, piece.stop)) if isinstance(value, FileRange)
                    else value for name, value in state.items()}
            self._store(piece, part, param)

    def _absorb(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the state already in `optimizer.state` to disk, one parameter at a time."""
        for param in [p for group in optimizer.param_groups for p in group["params"]]:
            if param in optimizer.state:
                self.load(optimizer, param, optimizer.state.pop(param))

    # ---- reading and writing ----------------------------------------------------------------------------------
    @staticmethod
    def _view(param: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The tensor the optimizer steps for `piece`: the parameter itself, or a slice sharing its storage."""
        if piece.start == 0 and piece.stop == param.numel():
            return param
        view = param.detach().view(-1)[piece.start:piece.stop]
        assert param.grad is not None
        view.grad = param.grad.detach().reshape(-1)[piece.start:piece.stop]
        return view

    def _path(self, key: str, name: str) -> Path:
        return self.directory / f"{key}.{name}.bin"

    def _read(self, key: str, device: torch.device = torch.device("cpu"), mapped: bool = False) -> dict[str, Any]:
        """`key`'s state: its scalars as the optimizer left them, its tensors read from their files (onto `device`,
        the parameter's, through the CPU: untested on a GPU; `mapped`: into maps of their own, for a checkpoint's
        reads one parameter after another: allocator.mapped_empty)."""
        state = dict(self.scalars.get(key, {}))
        for name, (shape, dtype) in self.files.get(key, {}).items():
            tensor = mapped_empty(shape, dtype) if mapped else torch.empty(shape, dtype=dtype)
            with open(self._path(key, name), "rb") as f:
                got = f.readinto(tensor.view(-1).view(torch.uint8).numpy().data)  # into the tensor's own bytes
            if got != tensor.numel() * tensor.element_size():
                raise OSError(f"offloaded optimizer state {self._path(key, name)} holds {got} bytes, expected "
                              f"{tensor.numel() * tensor.element_size()}: the offload directory was changed under the run")
            state[name] = tensor if device.type == "cpu" else tensor.to(device)
        return state

    def _store(self, piece: Piece, state: dict[str, Any], param: torch.Tensor) -> int:
        """Write `piece`'s state tensors to its files, keep its scalars; returns the bytes written."""
        key, disk = piece.key, 0
        self.scalars[key], self.files[key] = {}, {}
        for name, value in state.items():
            if isinstance(value, FileRange):  # bytes in another file (a checkpoint's, another offload's): copied over
                with open(self._path(key, name), "wb") as f:
                    disk += value.copy_into(f)
                self.files[key][name] = (value.shape, value.dtype)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                data = value.detach().contiguous().cpu()
                with open(self._path(key, name), "wb") as f:
                    f.write(data.view(-1).view(torch.uint8).numpy().data)
                self.files[key][name] = (tuple(data.shape), data.dtype)
                disk += data.numel() * data.element_size()
            else:
                self.scalars[key][name] = value
        if self.ratio[piece.group] is None:
            self.ratio[piece.group] = disk / max(1, (piece.stop - piece.start) * param.element_size())
        return disk


def attach(optimizer: torch.optim.Optimizer, directory: Union[str, Path], chunk_bytes: int) -> OptimizerOffload:
    """Keep `optimizer`'s state under `directory` from now on (its state so far moves there); `step_optimizer`
    and the checkpoint and switch code find it through `offload_of`."""
    offload = _OFFLOADS[optimizer] = OptimizerOffload(optimizer, directory, chunk_bytes)
    return offload


def offload_of(optimizer: Optional[torch.optim.Optimizer]) -> Optional[OptimizerOffload]:
    """The offload `attach` gave `optimizer`, or None (its state lives in `optimizer.state`)."""
    return _OFFLOADS.get(optimizer) if optimizer is not None else None


def step_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """One update: chunked through the disk where `optimizer` is offloaded, else `optimizer.step()`."""
    offload = offload_of(optimizer)
    if offload is not None:
        offload.step(optimizer)
    else:
        optimizer.step()


def optimizer_state_items(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    """(parameter, state) of every parameter with state: from disk one at a time where offloaded."""
    offload = offload_of(optimizer)
    if offload is not None:
        yield from offload.state_of(optimizer)
    else:
        yield from optimizer.state.items()
