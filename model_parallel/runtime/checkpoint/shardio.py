"""Shard files: safetensors, written and read a tensor at a time, nothing in them ever unpickled or executed.

A shard (`step_<N>/shard_<rank>.safetensors`) is a valid safetensors file (`safetensors.safe_open` reads it): an
8-byte little-endian header length, a JSON header padded with spaces to a multiple of 8 naming each tensor's
`dtype`, `shape` and `data_offsets` (contiguous, in order), then the tensors' bytes. Tensors are named by their
path in the payload {"params", "buffers", "optimizer", "extra"} (`params/fc.weight`, `optimizer/fc.weight/exp_avg`);
the header's `__metadata__` holds {"format": FORMAT, "skeleton": <JSON>}, the payload's other values with each
tensor a reference to its name (skeleton.py says how tuples, int keys, inf and nan are kept exactly).

Writing: the header is computed from shapes and dtypes first and written, then each tensor's bytes at its offset.
An offloaded optimizer's state (state.StreamedState) is copied from its files one parameter at a time just then
(FileRange, file to file), so a checkpoint write never holds more than one parameter's state. The sha256 is
computed by reading the file back in pieces.

Reading (`ShardReader`) parses the header itself: its length bounded, strict JSON (jsonbound), every entry checked
(a known dtype, a shape of whole numbers, offsets inside the file, contiguous, matching shape and dtype) before
anything is allocated. The skeleton's tensors are meta tensors carrying their record (offset, bytes); a tensor's
bytes are read when its section or parameter is asked for: a resume holds one parameter's optimizer state at a time.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from io import BufferedRandom, BufferedReader
from pathlib import Path
from typing import Any, Callable, Union

import torch

from model_parallel import jsonbound
from model_parallel.allocator import mapped_empty
from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint import skeleton as skel
from model_parallel.runtime.checkpoint.check import FIX
from model_parallel.runtime.checkpoint.state import StreamedState
from model_parallel.runtime.step.file_range import FileRange

FORMAT = "model_parallel.shard/2"
PIECE = 1 << 24  # bytes read or hashed at once
MAX_HEADER_BYTES = 100_000_000  # as the safetensors library bounds it: names and a skeleton, never tensor data
MAX_ELEMENTS = 1 << 62  # a shape past this is no tensor torch can describe
Handle = Union[BufferedRandom, BufferedReader]  # a shard opened to write (and read back) or to read
# safetensors' dtype names (its torch mapping); a dtype not here is refused on write.
DTYPES: dict[str, torch.dtype] = {name: dtype for name, dtype in (
    ("F64", torch.float64), ("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16),
    ("I64", torch.int64), ("I32", torch.int32), ("I16", torch.int16), ("I8", torch.int8), ("U8", torch.uint8),
    ("BOOL", torch.bool), ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
    ("F8_E5M2", getattr(torch, "float8_e5m2", None)), ("C64", torch.complex64),
    ("U64", getattr(torch, "uint64", None)), ("U32", getattr(torch, "uint32", None)),
    ("U16", getattr(torch, "uint16", None))) if dtype is not None}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, tensor or FileRange) of every one in nested dicts, lists and tuples."""
    if isinstance(obj, (torch.Tensor, FileRange)):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, path + (key,))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _walk(value, path + (index,))


def _map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
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


def _little_endian(where: object) -> None:
    if sys.byteorder != "little":
        raise CheckpointError(f"{where}: checkpoint shards are safetensors, little-endian; this machine is "
                              f"{sys.byteorder}-endian and does not read or write them")


def write_shard_file(handle: Handle, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                     optimizer: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any],
                     where: object = "checkpoint shard") -> tuple[int, str]:
    """Write the shard payload {"params", "buffers", "optimizer", "extra"} into `handle` (a new file opened for
    reading and writing; `where` names it in errors); returns (its size, its sha256)."""
    _little_endian(where)
    layout = optimizer.layout if isinstance(optimizer, StreamedState) else optimizer
    payload = {"params": dict(params), "buffers": dict(buffers),
               "optimizer": {name: dict(layout[name]) for name in layout}, "extra": dict(extra)}
    try:
        structure, tensors = skel.encode(payload, str(where))
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    del payload
    header = _header(structure, tensors, where)
    handle.write(header)
    records: dict[tuple[Any, ...], dict[tuple[Any, ...], tuple[int, Any]]] = {}  # by section (an optimizer entry)
    for path, begin, tensor in _offsets(tensors):
        records.setdefault(path[:2] if path[0] == "optimizer" else path[:1], {})[path] = (len(header) + begin, tensor)
    for section, source in (("params", params), ("buffers", buffers)):
        _fill(handle, (section,), source, records.get((section,), {}))
    ranges = optimizer.ranges if isinstance(optimizer, StreamedState) else None
    for name in layout:  # one parameter's optimizer state at a time: copied from the offload files, or in memory
        prefix = ("optimizer", name)
        _fill(handle, prefix, ranges(name) if ranges else optimizer[name], records.get(prefix, {}))
    _fill(handle, ("extra",), extra, records.get(("extra",), {}))
    handle.flush()
    return handle.seek(0, 2), hash_file(handle)


def _offsets(tensors: list[tuple[tuple[Any, ...], str, torch.Tensor]]) -> Iterator[tuple[tuple[Any, ...], int, Any]]:
    """(path, offset in the data, tensor) of each tensor, laid out one after another in the order given."""
    at = 0
    for path, _, tensor in tensors:
        yield path, at, tensor
        at += tensor.numel() * tensor.element_size()


def _header(structure: Any, tensors: list[tuple[tuple[Any, ...], str, torch.Tensor]], where: object) -> bytes:
    """The safetensors header (its length, then its JSON padded with spaces to a multiple of 8)."""
    entries: dict[str, Any] = {"__metadata__": {"format": FORMAT, "skeleton": json.dumps(
        structure, separators=(",", ":"), allow_nan=False)}}
    for (path, begin, tensor), (_, name, _) in zip(_offsets(tensors), tensors):
        if tensor.dtype not in _NAMES:
            raise CheckpointError(f"{where}: {'/'.join(map(str, path))} is {tensor.dtype}, which safetensors has no "
                                  f"name for; convert it to one of {sorted(str(d) for d in _NAMES)}")
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [begin, begin + nbytes]}
    text = json.dumps(entries, separators=(",", ":"), allow_nan=False).encode()
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise CheckpointError(f"{where}: the shard's header would be {len(text)} bytes, more than the "
                              f"{MAX_HEADER_BYTES} a reader accepts (too many tensors or too large an extra)")
    return struct.pack("<Q", len(text)) + text


def _fill(handle: Handle, prefix: tuple[Any, ...], source: Any, records: dict[tuple[Any, ...], tuple[int, Any]]) -> None:
    """Write each tensor of `source` (the payload's part at `prefix`) at the offset laid out for it in `records`
    (path -> (offset, the tensor laid out))."""
    tensors = [(prefix + path, tensor) for path, tensor in _walk(source)]
    laid = set(records)
    if laid != {path for path, _ in tensors}:  # a record left unwritten would read back as garbage
        raise CheckpointError(f"checkpoint shard: the tensors at {sorted(map(str, laid))[:4]} were laid out, "
                              f"{sorted(str(path) for path, _ in tensors)[:4]} came to be written; an offloaded "
                              f"optimizer must not step during a checkpoint")
    for path, tensor in tensors:
        offset, record = records[path]
        if tuple(record.shape) != tuple(tensor.shape) or record.dtype != tensor.dtype:
            raise CheckpointError(f"checkpoint shard: {'/'.join(map(str, path))} changed while it was written "
                                  f"(laid out as {tuple(record.shape)} {record.dtype}, now {tuple(tensor.shape)} "
                                  f"{tensor.dtype}); an offloaded optimizer must not step during a checkpoint")
        handle.seek(offset)
        if isinstance(tensor, FileRange):
            nbytes = record.numel() * record.element_size()
            if tensor.nbytes != nbytes:
                raise CheckpointError(f"checkpoint shard: {'/'.join(map(str, path))} lies in {tensor.nbytes} bytes of "
                                      f"files, its record holds {nbytes}")
            tensor.copy_into(handle)  # file to file, through a small buffer
        else:
            handle.write(_bytes(tensor))


def hash_file(handle: Handle) -> str:
    """The sha256 of an open file, read in pieces from its start."""
    handle.seek(0)
    digest, piece = hashlib.sha256(), bytearray(PIECE)  # one buffer: no piece allocated beside the last
    while got := handle.readinto(piece):
        digest.update(memoryview(piece)[:got])
    return digest.hexdigest()


class ShardReader:
    """A shard file's skeleton (tensors on the meta device, each with its `_shard_record`) and the reads that make
    its tensors real."""

    def __init__(self, file: Path, size: int) -> None:
        self.file, self.size = file, size
        _little_endian(file)
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise self._bad(f"{len(head)} bytes, shorter than a safetensors header")
            length = struct.unpack("<Q", head)[0]
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise self._bad(f"a header of {length} bytes (at most {min(MAX_HEADER_BYTES, size - 8)} fit)")
            text = handle.read(length)
        header = self._json(text, "header")
        if not isinstance(header, dict):
            raise self._bad("the header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()) \
                or meta.get("format") != FORMAT or "skeleton" not in meta:
            raise self._bad(f"no {FORMAT} metadata: not a model_parallel checkpoint shard")
        records = self._records(header, 8 + length)
        used: set[str] = set()

        def tensor(name: str) -> torch.Tensor:
            if name not in records or name in used:
                raise ValueError(f"the skeleton names the tensor {name[:60]!r} "
                                 f"{'twice' if name in used else 'the header does not hold'}")
            used.add(name)
            return records[name]
        try:
            self.skeleton = skel.decode(self._json(meta["skeleton"].encode(), "skeleton", skel.JSON_DEPTH), tensor)
        except ValueError as error:
            raise self._bad(f"skeleton: {error}") from None
        if used != set(records):
            raise self._bad(f"the header holds tensors the skeleton does not name: {sorted(set(records) - used)[:3]}")

    def _bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: cannot be read (not a checkpoint shard: {what}); {FIX}")

    def _json(self, text: bytes, what: str, depth: int = jsonbound.MAX_DEPTH) -> Any:
        try:
            return jsonbound.loads(text, where=what, error=ValueError, max_depth=depth)
        except ValueError as error:
            raise self._bad(str(error)) from None

    def _records(self, header: dict[str, Any], start: int) -> dict[str, torch.Tensor]:
        """Each entry of the header as a meta tensor with its record, all checked before anything is allocated."""
        records, spans = {}, []
        for name, entry in header.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise self._bad(f"the entry of {name[:60]!r} is not {{dtype, shape, data_offsets}}")
            dtype, shape, offsets = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None, \
                entry["shape"], entry["data_offsets"]
            if dtype is None:
                raise self._bad(f"{name[:60]!r} has the unknown dtype {str(entry['dtype'])[:20]!r}")
            if not isinstance(shape, list) or len(shape) > 64 or not all(type(d) is int and d >= 0 for d in shape) \
                    or math.prod(max(d, 1) for d in shape) >= MAX_ELEMENTS:
                raise self._bad(f"{name[:60]!r} has the shape {str(shape)[:60]}, not a list of sizes >= 0")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1] <= self.size - start):
                raise self._bad(f"{name[:60]!r} has data_offsets {str(offsets)[:60]}, outside the file's data")
            if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
                raise self._bad(f"{name[:60]!r} holds {offsets[1] - offsets[0]} bytes, its shape and dtype "
                                f"{math.prod(shape) * dtype.itemsize}")
            spans.append((offsets[0], offsets[1], name))
            records[name] = torch.empty(shape, dtype=dtype, device="meta")
            setattr(records[name], "_shard_record", (start + offsets[0], offsets[1] - offsets[0]))  # (offset, bytes)
        at = 0
        for begin, end, name in sorted(spans):
            if begin != at:
                raise self._bad(f"{name[:60]!r} starts at {begin}, not at {at}: the tensors overlap or leave a gap")
            at = end
        if start + at != self.size:
            raise self._bad(f"its tensors end at byte {start + at} of {self.size}")
        return records

    def materialize(self, obj: Any) -> Any:
        """`obj` (a part of the skeleton) with each meta tensor read from the file into a fresh CPU tensor."""
        with open(self.file, "rb") as handle:
            return _map(obj, lambda tensor: self._read(handle, tensor))

    def ranges(self, obj: Any) -> Any:
        """`obj` (a part of the skeleton) with each tensor of one dimension or more a FileRange over the file
        (nothing read: an offloaded optimizer copies it file to file), any other read as `materialize` does."""
        def place(tensor: torch.Tensor) -> Any:
            if tensor.dim() == 0:
                return self.materialize(tensor)
            return FileRange(tuple(tensor.shape), tensor.dtype, ((self.file, *self._record(tensor)),))
        return _map(obj, place)

    def _record(self, tensor: torch.Tensor) -> tuple[int, int]:
        """(offset, bytes) of a meta tensor's record, checked to lie inside the file."""
        offset, nbytes = getattr(tensor, "_shard_record", (None, 0))
        if offset is None:
            raise CheckpointError(f"{self.file}: a tensor of the shard's skeleton has no record; {FIX}")
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
        return out.set_(data.untyped_storage(), 0, tensor.shape, tensor.stride())
