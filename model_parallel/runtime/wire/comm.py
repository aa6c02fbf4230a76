"""Point-to-point messages between ranks: a list of values (tensors or small Python values) with a header.

A message is two or three transfers on one tag, in order:

    uint8[1024]     a fixed-size slot: 8 bytes little-endian header length n, then the first
                    bytes of the header (the receiver pre-posts it, so one round trip usually
                    carries the whole description)
    uint8[n - 1016] only when the header does not fit the slot: the rest of it
                    header JSON: one entry per value (`runtime.wire.structure.make_header`)
    tensors         the tensor values, in order, with the shapes/dtypes the header announced

So nothing about shapes is hard-coded and a boundary may carry any number of values. Small
Python values travel inside the header as JSON - never pickle. A message is flat: nested values
(a module's tuple output, a dict, a ModelOutput) are flattened by the caller (`structure.flatten`)
and their structure rides in the header, so it too costs nothing once the header is cached.

The engine's hot path passes a `HeaderCache` (both ends, with the same `stream`: the microbatch
index, so uneven microbatches of one step each keep their own shapes). Then the header is sent
only when it differs from the last one on that (peer, tag, stream), and the tensors travel packed
in one buffer, so a steady-state message is ONE transfer that the receiver pre-posts with the
known size (the data lands while it computes; no header round trip):

    uint8[size]     16-byte prefix (8 bytes little-endian: 0 = "same header as last time"),
                    then every tensor's bytes at 16-byte aligned offsets; the receiver's
                    tensors are views into this buffer (no copy)

When the header changed (or on the first message, where the receiver knows no size and posts
just the 16-byte prefix) the first transfer, still of the size the receiver pre-posted, is a
placeholder whose prefix holds the new header's length n, followed by two transfers on the
message's side tag (`side_tag`: the tag + SIDE_TAG_OFFSET)

    uint8[n]        the header JSON
    uint8[size']    the packed tensors in the new layout

So on its own tag a cached message is always exactly one transfer, of the size the receiver
expects: a receiver may post the receives of several messages of one (peer, tag) ahead (the
executor posts the next two; see executor.py), and the header of one message can never land in
the buffer posted for the next. (gloo sends only once the receive is posted, so a receive posted
late costs the sender's and the receiver's gloo threads an extra round trip on a busy machine.)

Cold calls. A rank that slept or waited (its compute, an emulated wait, a receive) comes back to cold
caches, and then every distinct torch call costs 10-60 µs instead of 1 (measured on the 2-core VM after an
8 ms sleep: `torch.empty` 24 µs, `read_prefix` 61, a slice, a view or a `copy_` 12-26 each), so a
message's cost on the critical path is mostly the number of torch calls between a receive's wake-up and
the next send. The cached hot path therefore makes as few as it can: a send reuses a spare packed buffer
of its layout (prefix still zero, its tensor views made; kept after a send completes, `SPARE_BYTES`,
`SPARE_COUNT`) and makes one `copy_` per tensor (plus `detach` when autograd tracks it); a receive makes
its values' views when it is posted (before the data lands) and reads the prefix through ctypes, so
its `wait` makes no torch call besides gloo's (docs/runtime.md, "What one message costs").

A sender may narrow its floating-point tensors to a `wire_dtype` (bf16 training: half the bytes).
Such a tensor is announced with its wire dtype and `"cast"`: the dtype it had, which the receiver
restores, so the receiving stage computes on the value rounded to the wire dtype, in its own dtype
(a single-process run does the same rounding at the cut: `structure.cross`).

Both ends update their cache after each message, so they agree as long as every message sent is
received (true at every step boundary: the engine drains all its sends and receives per step,
and every rank clears its cache on `activate`). Every wait has a timeout; a
failure is turned into a `PeerError` by the caller (see `health.py`), which names the dead rank.
Messages between one pair of ranks on one tag are matched in order, which is why schedules keep
microbatches in increasing order.
"""
from __future__ import annotations

import ctypes
import json
import math
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache, partial
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from model_parallel.errors import PeerError
from model_parallel.runtime.wire.packed import (ALIGN, MAX_HEADER_BYTES, HeaderCache, Known, known_header, parse_header,
                                                read_prefix, received, unpack, view, write_prefix)
from model_parallel.runtime.wire.packed import dtype_named as _dtype_named
from model_parallel.runtime.wire.structure import decode_value, encode_value, make_header, structure_of

TAG_ACTIVATION = 1
TAG_GRADIENT = 2
TAG_MIGRATION = 3
TAG_TOTALS = 4  # the step's reduction through the last stage's rank (wire/step_totals.py), on the control group
EDGE_TAGS = 16  # several stages per rank (interleaved): each stage edge e has tags 16 + 2e (activations), 17 + 2e
SIDE_TAG_OFFSET = 1 << 20  # a cached message's new header and repacked tensors: above every other tag


def side_tag(tag: int) -> int:
    """The tag a cached message on `tag` sends a changed header and its tensors on (module docstring)."""
    return tag + SIDE_TAG_OFFSET


def edge_tag(base: int, edge: Optional[int]) -> int:
    """The tag of messages of kind `base` (TAG_ACTIVATION or TAG_GRADIENT) on the edge between stages `edge` and
    `edge` + 1: `base` itself when `edge` is None (one stage per rank), else one tag per edge, so the
    messages of two edges between the same two ranks (interleaved 1F1B) are never matched with each other."""
    return base if edge is None else EDGE_TAGS + 2 * edge + (base - TAG_ACTIVATION)

# A packed buffer up to this size is kept after its send for the next message of its layout, at most
# SPARE_COUNT per (peer, tag, stream): a steady-state send then allocates nothing ("Cold calls" above).
SPARE_BYTES = 256 << 10
SPARE_COUNT = 2
SLOT_BYTES = 1024  # fixed first transfer: length + the start of the header
_SLOT_ROOM = SLOT_BYTES - 8


# ---- the send side of a cached message (packed.py has the layout; the send path stays in this module) ----
def _signature(values: list[Any], structure: Any, wire_dtype: Optional[torch.dtype]) -> Any:
    """Everything `make_header` reads from these arguments, as a comparable tuple: two calls with equal
    signatures make byte-identical headers. Tensors by shape, dtype and requires_grad (the header's
    fields; narrowing follows from dtype and wire_dtype; the layout from the strides); other values and the structure by
    their JSON text, since Python's == would call 1, 1.0 and True equal where the header does not."""
    parts: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            parts.append((value.shape, value.dtype, value.requires_grad, value.stride()))
        else:
            parts.append(json.dumps(encode_value(value)))
    text = None if structure is None else json.dumps(structure, separators=(",", ":"))
    return wire_dtype, text, tuple(parts)


def _packed(known: Known, device: torch.device) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """A buffer of `known`'s layout with a zero prefix ("same header") and a view of it per tensor (None: empty)."""
    buffer = torch.empty(known.size, dtype=torch.uint8, device=device)
    buffer[:ALIGN].zero_()  # the rest is written by every message (a spare's prefix is never written again)
    return buffer, [view(buffer[offset:offset + nbytes], dtype, shape, stride) if nbytes else None
                    for offset, shape, dtype, nbytes, stride in known.tensors]


def _fill(packed: tuple[torch.Tensor, list[Optional[torch.Tensor]]], tensors: list[torch.Tensor]) -> torch.Tensor:
    for view, tensor in zip(packed[1], tensors):
        if view is not None:  # copy_ narrows a float32 tensor to the wire dtype in place (no extra allocation)
            view.copy_(tensor)
    return packed[0]


def _pack(tensors: list[torch.Tensor], known: Known, device: torch.device) -> torch.Tensor:
    """One buffer: a zero prefix ("same header") and the tensors' bytes at the layout's offsets."""
    return _fill(_packed(known, device), tensors)


def _send_cached(values: list[Any], dst: int, tag: int, group: Any, device: torch.device, cache: HeaderCache,
                 stream: Any, structure: Any, wire_dtype: Optional[torch.dtype]) -> "SendHandle":
    sig = _signature(values, structure, wire_dtype)
    # detach only what autograd tracks: each torch call on this path costs tens of µs cold ("Cold calls")
    tensors = [v.detach() if v.requires_grad else v for v in values if isinstance(v, torch.Tensor)]
    key = (dst, tag, stream)
    known = cache.sent.get(key)
    buffers: list[torch.Tensor] = []
    nbytes = 0
    if known is None or known.signature != sig:
        header_list = make_header(values, structure, wire_dtype)
        header = json.dumps(header_list, separators=(",", ":")).encode()
        if known is None or known.data != header:
            # The receiver pre-posted `known.size` bytes (just the prefix if it knows nothing yet): a placeholder
            # whose prefix is the new header's length; the header and the tensors follow on the side tag.
            first = torch.zeros(known.size if known is not None else ALIGN, dtype=torch.uint8, device=device)
            write_prefix(first, len(header))
            buffers += [first, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)]
            nbytes = (known.size if known is not None else ALIGN) + len(header)
        known = cache.sent[key] = known_header(header, header_list, sig)
    # Steady state: a spare buffer of this layout (its prefix still zero, its views made) and one copy_ per tensor.
    packed = known.spare.pop() if known.spare else _packed(known, device)
    buffers.append(_fill(packed, tensors))
    # Only the first transfer on the message's tag; a new header and its tensors on the side tag.
    works = [start_work(partial(_isend, b, dst, group, tag if i == 0 else side_tag(tag)), dst, "send")
             for i, b in enumerate(buffers)]
    return SendHandle(works, buffers, dst, nbytes + known.size, known.spare if known.size <= SPARE_BYTES else None,
                      packed)


def _isend(buffer: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
    """`dist.isend`; on the default group straight on the process group (the wrapper's checks cost
    about as much as gloo posting the send, once per message on the hot path)."""
    world = dist.group.WORLD  # None before init_process_group: then dist.isend raises torch's own error
    if group is None and world is not None:
        return world.send([buffer], dst, tag)
    return dist.isend(buffer, dst, group=group, tag=tag)


def _irecv(buffer: torch.Tensor, src: int, group: Any, tag: int) -> Any:
    """`dist.irecv`; on the default group straight on the process group (see `_isend`)."""
    world = dist.group.WORLD  # see `_isend`
    if group is None and world is not None:
        return world.recv([buffer], src, tag)
    return dist.irecv(buffer, src, group=group, tag=tag)


# ---- sending / receiving -------------------------------------------------------------------------
@dataclass
class SendHandle:
    """Outstanding isends of one message; keep the buffers alive until `wait`."""

    works: list[Any]
    buffers: list[torch.Tensor]
    peer: int
    nbytes: int = 0  # bytes put on the wire (every transfer of the message)
    # Where the packed buffer goes back once sent, for the next message of its layout (None: not kept).
    spare: Optional[list[Any]] = None
    packed: Any = None

    def wait(self, timeout: float) -> None:
        for work in self.works:
            wait_work(work, timeout, self.peer, "send")
        # Only after every transfer completed (a failed wait raised above): gloo no longer reads the buffer.
        if self.spare is not None and self.works and len(self.spare) < SPARE_COUNT:
            self.spare.append(self.packed)
        self.works.clear()
        self.buffers.clear()
        self.spare = self.packed = None


@lru_cache(maxsize=64)
def _delta(seconds: float) -> timedelta:
    """`timeout` as the timedelta Work.wait takes, built once per value (building one costs ~10 µs cold)."""
    return timedelta(seconds=seconds)


def wait_work(work: Any, timeout: float, peer: int, what: str) -> None:
    """Wait for a torch.distributed work handle; failure or timeout becomes a PeerError (peer -1: a collective)."""
    try:
        ok = work.wait(_delta(timeout))
    except RuntimeError as error:
        where = what if peer < 0 else f"{what} with rank {peer}"
        raise PeerError(f"{where} failed: {str(error).splitlines()[0][:200]}") from error
    if ok is False:
        where = what if peer < 0 else f"{what} with rank {peer}"
        raise PeerError(f"{where} timed out after {timeout:.0f} s")


def new_group(timeout: float, ranks: Optional[Sequence[int]] = None, backend: Optional[str] = "gloo",
              what: str = "creating a process group") -> Any:
    """`dist.new_group` with the run's deadline: a collective every rank of the world calls, and torch's own
    default for gloo is 30 minutes. A rank that never calls it (it exited after joining) or a store host that
    left is a PeerError after `timeout` (the caller's diagnosis then names the rank)."""
    try:
        return dist.new_group(list(ranks) if ranks is not None else None, backend=backend, timeout=_delta(timeout))
    except RuntimeError as error:  # DistStoreError: a rank never came; DistNetworkError: the store host left
        raise PeerError(f"{what} failed within {timeout:g} s: {str(error).splitlines()[0][:200]}") from error


def start_work(start: Callable[[], Any], peer: int, what: str) -> Any:
    """Post a send/receive. Gloo raises at once when the connection to `peer` already broke (it died, or
    this rank stood still and the peer gave up on it): the same PeerError as a failed wait."""
    try:
        return start()
    except RuntimeError as error:
        raise PeerError(f"{what} with rank {peer} failed: {str(error).splitlines()[0][:200]}") from error


def send_values(values: list[Any], dst: int, tag: int, group: Any = None, device: Optional[torch.device] = None,
                cache: Optional[HeaderCache] = None, stream: Any = None, structure: Any = None,
                wire_dtype: Optional[torch.dtype] = None) -> SendHandle:
    """Start sending `values` to rank `dst` (non-blocking); returns a handle to wait on. `structure`
    (JSON, see structure.py) travels in the header; the receiver reads it as `PendingRecv.structure`.
    With `wire_dtype`, values that are wider floating-point tensors travel narrowed to it, and arrive rounded, in their own dtype (see the module docstring).

    With `cache` the receiver must pass a cache and the same `stream` too (see the module docstring)."""
    device = device or torch.device("cpu")
    if cache is not None:
        return _send_cached(values, dst, tag, group, device, cache, stream, structure, wire_dtype)
    header_list = make_header(values, structure, wire_dtype)
    header = json.dumps(header_list, separators=(",", ":")).encode()
    slot = bytearray(SLOT_BYTES)
    slot[:8] = len(header).to_bytes(8, "little")
    head = header[:_SLOT_ROOM]
    slot[8:8 + len(head)] = head
    buffers = [torch.frombuffer(slot, dtype=torch.uint8).to(device)]
    if len(header) > _SLOT_ROOM:
        buffers.append(torch.frombuffer(bytearray(header[_SLOT_ROOM:]), dtype=torch.uint8).to(device))
    buffers += [_flat(v, e, device) for v, e in zip(values, header_list) if isinstance(v, torch.Tensor)]
    works = [start_work(partial(dist.isend, b, dst, group=group, tag=tag), dst, "send") for b in buffers]
    return SendHandle(works, buffers, dst, sum(b.numel() * b.element_size() for b in buffers))


def _flat(value: torch.Tensor, entry: dict[str, Any], device: torch.device) -> torch.Tensor:
    """`value`'s bytes as one row-major run in the header entry's dtype, laid out by its "stride" if it has one."""
    dtype = _dtype_named(entry["dtype"])
    if "stride" not in entry:
        return value.detach().to(dtype).contiguous()
    flat = torch.empty(value.numel(), dtype=dtype, device=device)
    flat.as_strided(value.shape, entry["stride"]).copy_(value.detach())
    return flat


class PendingRecv:
    """A message being received from `src`: the header slot is posted at construction (so it can
    land while we compute) - with a `cache` that knows this (src, tag, stream), the whole packed
    message; `wait()` completes the header and receives the tensors (then `structure` holds the
    structure the sender passed, or None)."""

    def __init__(self, src: int, tag: int, group: Any = None, device: Optional[torch.device] = None,
                 cache: Optional[HeaderCache] = None, stream: Any = None) -> None:
        self.src, self.tag, self.group, self.cache, self.stream = src, tag, group, cache, stream
        self.device = device or torch.device("cpu")
        self.known: Optional[Known] = None
        self.structure: Any = None
        self.prefix: Any = None  # the slot's first 8 bytes as a ctypes array (CPU): read with no torch call
        self.ready: Optional[list[Any]] = None  # the values, as views of the slot, made before the data lands
        if cache is not None:
            self.known = cache.received.get((src, tag, stream))
            size = self.known.size if self.known is not None else ALIGN
        else:
            size = SLOT_BYTES
        self.slot = torch.empty(size, dtype=torch.uint8, device=self.device)
        if cache is not None and self.slot.device.type == "cpu":
            self.prefix = (ctypes.c_uint8 * 8).from_address(self.slot.data_ptr())  # self.slot keeps it alive
        if self.known is not None and not self.known.widens:  # a widened value is a copy: made on arrival
            self.ready = unpack(self.slot, self.known, self.device)
        self.work = start_work(lambda: _irecv(self.slot, src, group, tag), src, "receive")

    def _recv_side(self, nbytes: int, timeout: float) -> torch.Tensor:
        """The next transfer of `nbytes` on this message's side tag (a changed header, its tensors)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        work = start_work(lambda: _irecv(buffer, self.src, self.group, side_tag(self.tag)), self.src, "receive")
        wait_work(work, timeout, self.src, "receive")
        return buffer

    def _wait_cached(self, timeout: float) -> list[Any]:
        assert self.cache is not None
        size = int.from_bytes(bytes(self.prefix), "little") if self.prefix is not None else read_prefix(self.slot)
        if size == 0 and self.known is not None:
            self.structure = self.known.structure
            return self.ready if self.ready is not None else unpack(self.slot, self.known, self.device)
        if not 0 < size <= MAX_HEADER_BYTES:
            raise PeerError(f"rank {self.src} sent a message header of {size} bytes; expected 1..{MAX_HEADER_BYTES} "
                            "(are both ranks running the same plan and schedule?)")
        data = self._recv_side(size, timeout).cpu().numpy().tobytes()
        header = parse_header(data, self.src)
        known = self.cache.received[(self.src, self.tag, self.stream)] = known_header(data, header)
        self.structure = known.structure
        return unpack(self._recv_side(known.size, timeout), known, self.device)

    def wait(self, timeout: float) -> list[Any]:
        wait_work(self.work, timeout, self.src, "receive")
        if self.cache is not None:
            return self._wait_cached(timeout)
        slot = self.slot.cpu().numpy().tobytes()
        size = int.from_bytes(slot[:8], "little")
        if not 0 < size <= MAX_HEADER_BYTES:
            raise PeerError(f"rank {self.src} sent a message header of {size} bytes; expected 1..{MAX_HEADER_BYTES} "
                            "(are both ranks running the same plan and schedule?)")
        data = slot[8:8 + min(size, _SLOT_ROOM)]
        if size > _SLOT_ROOM:
            rest = torch.empty(size - _SLOT_ROOM, dtype=torch.uint8, device=self.device)
            work = start_work(lambda: dist.irecv(rest, self.src, group=self.group, tag=self.tag), self.src, "receive")
            wait_work(work, timeout, self.src, "receive")
            data += rest.cpu().numpy().tobytes()
        header = parse_header(data, self.src)
        self.structure = structure_of(header)
        header = [entry for entry in header if entry["t"] != "structure"]
        values: list[Any] = []
        works = []
        for entry in header:
            if entry["t"] == "tensor":
                dtype, shape = _dtype_named(entry["dtype"]), tuple(entry["shape"])
                flat = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=self.device)
                works.append(start_work(partial(dist.irecv, flat, self.src, group=self.group, tag=self.tag),
                                        self.src, "receive"))
                stride = tuple(entry["stride"]) if "stride" in entry else None
                values.append((view(flat, dtype, shape, stride), entry["grad"]))
            else:
                values.append((None, decode_value(entry["v"], self.device)))
        for work in works:
            wait_work(work, timeout, self.src, "receive")
        out = []
        for entry, (tensor, extra) in zip(header, values):
            if entry["t"] == "tensor":
                out.append(received(tensor, _dtype_named(entry["cast"]) if "cast" in entry else None, bool(entry["grad"])))
            else:
                out.append(extra)
        return out
