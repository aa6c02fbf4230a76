"""Shard files written and read a tensor at a time: the torch.save layout laid out first, its bytes streamed in.

A shard is one torch.save zip file, as it always was (torch.load(weights_only=True) reads it whole). It is written
in two passes over one file: `torch.save` of the payload with every tensor replaced by a fake tensor of its shape
and dtype (torch.serialization.skip_data: records of the right sizes, no bytes), then each tensor's bytes at its
record's offset, which torch.load(map_location="meta") of that same file gives. An offloaded optimizer's state
(state.StreamedState) is read from its files one parameter at a time just then, so a checkpoint write never holds
more than one parameter's state; nothing is cloned. The sha256 is computed by reading the file back in pieces.

Reading is the reverse (`ShardReader`): the file's skeleton is loaded with map_location="meta" (shapes, dtypes,
scalars and offsets; weights_only, nothing else unpickled) and a tensor's bytes are read from its offset when its
section or parameter is asked for: a resume holds one parameter's optimizer state at a time.
"""
from __future__ import annotations

import hashlib
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from io import BufferedRandom, BufferedReader
from typing import Any, Callable, Union

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from model_parallel.allocator import mapped_empty
from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint.check import FIX
from model_parallel.runtime.checkpoint.state import StreamedState
from model_parallel.runtime.step.file_range import FileRange

PIECE = 1 << 24  # bytes read or hashed at once
Handle = Union[BufferedRandom, BufferedReader]  # a shard opened to write (and read back) or to read


def _walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, tensor or FileRange) of every one in nested dicts, lists and tuples (what weights_only reads back)."""
    if isinstance(obj, (torch.Tensor, FileRange)):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, path + (key,))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _walk(value, path + (index,))


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` rebuilt with `fn` applied to each tensor (containers keep their types)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return (OrderedDict if isinstance(obj, OrderedDict) else dict)((k, _map(v, fn)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map(v, fn) for v in obj)
    return obj


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's data, contiguous on the CPU, as raw bytes (bfloat16 too: viewed as uint8)."""
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return data.view(torch.uint8).numpy().data if data.numel() else memoryview(b"")


def write_shard_file(handle: Handle, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                     optimizer: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any]) -> tuple[int, str]:
    """Write the shard payload {"params", "buffers", "optimizer", "extra"} into `handle` (a new file opened for
    reading and writing); returns (its size, its sha256)."""
    layout = optimizer.layout if isinstance(optimizer, StreamedState) else optimizer
    with FakeTensorMode():
        fake = lambda t: torch.empty(tuple(t.shape), dtype=t.dtype)  # noqa: E731 - no memory, shape and dtype only
        skeleton = {"params": _map(dict(params), fake), "buffers": _map(dict(buffers), fake),
                    "optimizer": {name: _map(dict(layout[name]), fake) for name in layout},
                    "extra": _map(dict(extra), fake)}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, handle)
    del skeleton
    handle.flush()
    handle.seek(0)
    records = torch.load(handle, map_location="meta", weights_only=True)
    for section, source in (("params", params), ("buffers", buffers), ("extra", extra)):
        _fill(handle, source, records[section])
    ranges = optimizer.ranges if isinstance(optimizer, StreamedState) else None
    for name in layout:  # one parameter's optimizer state at a time: copied from the offload files, or in memory
        _fill(handle, ranges(name) if ranges else optimizer[name], records["optimizer"][name])
    handle.flush()
    return handle.seek(0, 2), hash_file(handle)


def _fill(handle: Handle, source: Any, records: Any) -> None:
    """Write each tensor of `source` at the offset of the record `records` (the loaded skeleton) holds for it."""
    where, tensors = dict(_walk(records)), list(_walk(source))
    if set(where) != {path for path, _ in tensors}:  # a record left unwritten would read back as zeros
        raise CheckpointError(f"checkpoint shard: the tensors at {sorted(map(str, where))[:4]} were laid out, "
                              f"{sorted(str(path) for path, _ in tensors)[:4]} came to be written; an offloaded "
                              f"optimizer must not step during a checkpoint")
    for path, tensor in tensors:
        record = where[path]
        if tuple(record.shape) != tuple(tensor.shape) or record.dtype != tensor.dtype:
            raise CheckpointError(f"checkpoint shard: {'/'.join(map(str, path))} changed while it was written "
                                  f"(laid out as {tuple(record.shape)} {record.dtype}, now {tuple(tensor.shape)} "
                                  f"{tensor.dtype}); an offloaded optimizer must not step during a checkpoint")
        handle.seek(_offset(record))
        if isinstance(tensor, FileRange):
            if tensor.nbytes != record.untyped_storage().nbytes():
                raise CheckpointError(f"checkpoint shard: {'/'.join(map(str, path))} lies in {tensor.nbytes} bytes of "
                                      f"files, its record holds {record.untyped_storage().nbytes()}")
            tensor.copy_into(handle)  # file to file, through a small buffer
        else:
            handle.write(_bytes(tensor))


def _offset(record: torch.Tensor) -> int:
    """Where a meta tensor's bytes start in the file torch.load(map_location="meta") read it from."""
    offset = record.untyped_storage()._checkpoint_offset
    if offset is None:
        raise CheckpointError("checkpoint shard: a tensor's record has no offset (torch.load did not record it); "
                              "this torch cannot stream shards")
    return int(offset)


def hash_file(handle: Handle) -> str:
    """The sha256 of an open file, read in pieces from its start."""
    handle.seek(0)
    digest, piece = hashlib.sha256(), bytearray(PIECE)  # one buffer: no piece allocated beside the last
    while got := handle.readinto(piece):
        digest.update(memoryview(piece)[:got])
    return digest.hexdigest()


class ShardReader:
    """A shard file's skeleton (tensors on the meta device) and the reads that make its tensors real."""

    def __init__(self, file: Path, size: int) -> None:
        self.file, self.size = file, size
        with open(file, "rb") as handle:
            self._check_byteorder(handle)
            handle.seek(0)
            # Meta tensors: each storage records its offset in the file; no tensor bytes are read.
            self.skeleton = torch.load(handle, map_location="meta", weights_only=True)

    def _check_byteorder(self, handle: Handle) -> None:
        """A shard of another byte order is refused (torch.load would swap it; these raw reads do not)."""
        with zipfile.ZipFile(handle) as archive:
            names = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "byteorder"]
            order = archive.read(names[0]).decode(errors="replace") if names else sys.byteorder
        if order != sys.byteorder:
            raise CheckpointError(f"{self.file}: the shard was written on a {order}-endian machine, this one is "
                                  f"{sys.byteorder}-endian; convert it with torch.load/torch.save there")

    def materialize(self, obj: Any) -> Any:
        """`obj` (a part of the skeleton) with each meta tensor read from the file into a fresh CPU tensor."""
        with open(self.file, "rb") as handle:
            return _map(obj, lambda tensor: self._read(handle, tensor))

    def ranges(self, obj: Any) -> Any:
        """`obj` (a part of the skeleton) with each tensor that is its whole record a FileRange over the file
        (nothing read: an offloaded optimizer copies it file to file), any other read as `materialize` does."""
        def place(tensor: torch.Tensor) -> Any:
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.dim() == 0 or not tensor.is_contiguous() or tensor.storage_offset() or \
                    tensor.untyped_storage().nbytes() != nbytes:
                return self.materialize(tensor)
            return FileRange(tuple(tensor.shape), tensor.dtype, ((self.file, self._record(tensor)[0], nbytes),))
        return _map(obj, place)

    def _record(self, tensor: torch.Tensor) -> tuple[int, int]:
        """(offset, bytes) of a meta tensor's record, checked to lie inside the file (the skeleton is data)."""
        offset, nbytes = _offset(tensor), tensor.untyped_storage().nbytes()
        if offset < 0 or offset + nbytes > self.size:
            raise CheckpointError(f"{self.file}: a tensor's record ({nbytes} bytes at {offset}) lies outside the "
                                  f"{self.size}-byte shard; {FIX}")
        return offset, nbytes

    def _read(self, handle: Handle, tensor: torch.Tensor) -> torch.Tensor:
        offset, nbytes = self._record(tensor)  # checked before allocating
        data = mapped_empty((nbytes,), torch.uint8)  # not from the heap: allocator.mapped_empty says why
        handle.seek(offset)
        got = handle.readinto(data.numpy().data) if nbytes else 0
        if got != nbytes:
            raise CheckpointError(f"{self.file}: a tensor's record ended {nbytes - got} bytes early; resume from an "
                                  f"earlier step")
        out = torch.empty(0, dtype=tensor.dtype)
        return out.set_(data.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
