"""A message's cached form on the wire (runtime/wire/comm.py's hot path): the parsed header with its packed layout,
the header cache both ends keep, and viewing a received buffer's values (the send side, which is handed the
activations, stays in comm.py: a forward send passes as few modules as it can, tests/integration/test_send_path.py).

comm.py's docstring describes the protocol; this module owns the layout: a 16-byte prefix (8 bytes little-endian:
0 = "same header as last time", else the new header's length), then every tensor's bytes at 16-byte aligned offsets.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from model_parallel import jsonbound
from model_parallel.errors import PeerError
from model_parallel.runtime.wire.structure import decode_value, is_dense, structure_of

ALIGN = 16  # prefix size and tensor alignment in a packed buffer (any dtype can be viewed there)
MAX_HEADER_BYTES = 64 << 20  # a header larger than this is garbage, not a boundary description
MAX_MESSAGE_BYTES = 1 << 40  # the tensors of one message: 1 TiB is no host's activation; more is garbage
MAX_DIMS = 64
_KINDS = {"tensor": {"t", "shape", "dtype", "grad", "cast", "stride"}, "json": {"t", "v"}, "structure": {"t", "v"}}


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Known:
    """A header as sent on the wire, parsed, with the packed layout of its tensors."""

    data: bytes
    entries: tuple[dict[str, Any], ...]  # the parsed header (not mutated)
    # (offset, shape, dtype, nbytes, strides or None: row-major); `view` makes the tensor a buffer holds there
    tensors: tuple[tuple[int, tuple[int, ...], torch.dtype, int, Optional[tuple[int, ...]]], ...]
    size: int  # bytes of the packed buffer, prefix included
    structure: Any = None  # the header's structure entry, parsed once (not per message)
    # Sender: `signature` of the values this header describes, so a steady-state send compares a
    # tuple instead of building and encoding the header again (None: compare the header bytes).
    signature: Any = None
    # Receiver: per value, how to rebuild it from the packed buffer (computed once, not per message):
    # ("tensor", start, end, wire dtype, shape, dtype to widen to or None, requires_grad, strides or None)
    # or ("json", encoded).
    layout: tuple[tuple[Any, ...], ...] = ()
    # Sender: packed buffers of this layout whose sends completed, reused by the next message (comm.py, "Cold
    # calls"); each is (buffer, one view per tensor, None for an empty one). Mutable; not part of the value.
    spare: list[tuple[torch.Tensor, list[Optional[torch.Tensor]]]] = field(default_factory=list, compare=False,
                                                                          repr=False)
    # Receiver: whether a value is widened on arrival (a copy, so it cannot be prepared before the data lands).
    widens: bool = False


def dtype_named(name: Any) -> torch.dtype:
    """A dtype named in a header; anything else is a protocol error, never an arbitrary torch attribute."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise PeerError(f"a message header names dtype {str(name)[:40]!r}, which is not a torch dtype "
                        "(are both ranks running the same version of model_parallel?)")
    return dtype


def parse_header(data: bytes, src: int) -> list[dict[str, Any]]:
    """A header received from rank `src`, checked before anything is allocated from it: a JSON list of the
    entries `structure.make_header` writes, every dtype a torch dtype, every shape a list of at most MAX_DIMS
    non-negative ints, the tensors MAX_MESSAGE_BYTES at most in all. Anything else is a PeerError naming
    `src` (a 2^62-element shape was a RuntimeError from torch.empty, a missing key a KeyError)."""
    fix = "are both ranks running the same version of model_parallel?"
    header = jsonbound.loads(data, where=f"rank {src}'s message header", error=PeerError, fix=fix,
                             max_bytes=MAX_HEADER_BYTES, allow_nan=True)

    def bad(entry: Any, why: str) -> PeerError:
        return PeerError(f"rank {src} sent a malformed message header (entry {str(entry)[:120]}: {why}); {fix}")

    if not isinstance(header, list):
        raise bad(header, "the header is a JSON list of entries")
    total = 0
    for entry in header:
        kind = entry.get("t") if isinstance(entry, dict) else None
        if not isinstance(kind, str) or kind not in _KINDS or not set(entry) <= _KINDS[kind]:
            raise bad(entry, "expected an object with t = tensor, json or structure and only that kind's keys")
        if kind != "tensor":
            if "v" not in entry:
                raise bad(entry, "no value 'v'")
            continue
        itemsize = dtype_named(entry.get("dtype")).itemsize  # a PeerError for anything but a torch dtype
        if "cast" in entry:
            dtype_named(entry["cast"])
        shape = entry.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_MESSAGE_BYTES for d in shape):
            raise bad(entry, f"a shape is a list of at most {MAX_DIMS} integers >= 0")
        if not isinstance(entry.get("grad"), bool):
            raise bad(entry, "'grad' is true or false")
        # as_strided over the packed buffer: strides that overlap or leave gaps would read past the tensor's bytes
        stride = entry.get("stride", shape)  # absent: row-major (shape itself passes the checks below)
        if not (isinstance(stride, list) and len(stride) == len(shape) and all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_MESSAGE_BYTES for s in stride)):
            raise bad(entry, f"'stride' is a list of {len(shape)} integers >= 0")
        if "stride" in entry and not is_dense(shape, stride):
            raise bad(entry, "'stride' lays the shape over exactly its elements (a permutation of row-major)")
        total += math.prod(shape) * itemsize
        if total > MAX_MESSAGE_BYTES:
            raise bad(entry, f"the message's tensors would take more than {MAX_MESSAGE_BYTES} bytes")
    return header


def known_header(data: bytes, header: list[dict[str, Any]], signature: Any = None) -> Known:
    offset = ALIGN
    tensors: list[tuple[int, tuple[int, ...], torch.dtype, int, Optional[tuple[int, ...]]]] = []
    layout: list[tuple[Any, ...]] = []  # one `Known.layout` entry per value
    for entry in header:
        if entry["t"] == "tensor":
            dtype = dtype_named(entry["dtype"])
            shape = tuple(entry["shape"])
            nbytes = math.prod(shape) * dtype.itemsize
            stride = tuple(entry["stride"]) if "stride" in entry else None
            tensors.append((offset, shape, dtype, nbytes, stride))
            cast = dtype_named(entry["cast"]) if "cast" in entry else None
            layout.append(("tensor", offset, offset + nbytes, dtype, shape, cast, bool(entry["grad"]), stride))
            offset = aligned(offset + nbytes)
        elif entry["t"] != "structure":
            layout.append(("json", entry["v"]))
    widens = any(item[0] == "tensor" and item[5] is not None for item in layout)
    return Known(data, tuple(header), tuple(tensors), offset, structure_of(header), signature, tuple(layout),
                 widens=widens)


class HeaderCache:
    """The last header sent to / received from each (peer, tag, stream); see the module docstring.

    One per process; both ends of a (peer, tag) use one or neither, with the same stream for each
    message, and start from empty together (the engine clears it on every `activate`, a collective).
    """

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int, Any], Known] = {}
        self.received: dict[tuple[int, int, Any], Known] = {}

    def clear(self) -> None:
        self.sent.clear()
        self.received.clear()


def write_prefix(buffer: torch.Tensor, value: int) -> None:
    buffer[:8] = torch.frombuffer(bytearray(value.to_bytes(8, "little")), dtype=torch.uint8)


_LITTLE = sys.byteorder == "little"


def read_prefix(buffer: torch.Tensor) -> int:
    # One int64 view and item() (a few microseconds; the prefix is read once per message).
    value = int(buffer[:8].view(torch.int64).item())
    return value if _LITTLE else int.from_bytes(value.to_bytes(8, sys.byteorder, signed=True), "little")


def received(tensor: torch.Tensor, cast: Optional[torch.dtype], grad: bool) -> torch.Tensor:
    """A received tensor as the receiver uses it: widened back to its announced dtype (a copy, so a
    fresh leaf), floating-point ones with the sender's requires_grad."""
    if cast is not None:
        tensor = tensor.to(cast)
    # A fresh view or copy never requires grad: set it only when it must (a torch call costs ~10 µs cold).
    return tensor.requires_grad_() if grad and tensor.is_floating_point() else tensor


def view(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], stride: Optional[tuple[int, ...]]) -> torch.Tensor:
    """The tensor of `shape` whose bytes `flat` holds (1-D uint8), row-major or laid out by `stride` (a dense layout,
    checked by parse_header): both ends of a message view their buffer so, so the values keep the sender's strides."""
    typed = flat.view(dtype)
    return typed.view(shape) if stride is None else typed.as_strided(shape, stride)


def unpack(buffer: torch.Tensor, known: Known, device: torch.device) -> list[Any]:
    """The message's values: tensors are views into `buffer` (leaves; float ones get the sender's requires_grad)."""
    out: list[Any] = []
    for item in known.layout:
        if item[0] == "tensor":
            _, start, end, dtype, shape, cast, grad, stride = item
            out.append(received(view(buffer[start:end], dtype, shape, stride), cast, grad))
        else:
            out.append(decode_value(item[1], device))
    return out
