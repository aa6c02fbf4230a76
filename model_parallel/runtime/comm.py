"""Point-to-point messages between ranks: a list of values (tensors or small Python values) with a header.

A message is two or three transfers on one tag, in order:

    uint8[1024]     a fixed-size slot: 8 bytes little-endian header length n, then the first
                    bytes of the header (the receiver pre-posts it, so one round trip usually
                    carries the whole description)
    uint8[n - 1016] only when the header does not fit the slot: the rest of it
                    header JSON: one entry per value
                    {"t": "tensor", "shape": [...], "dtype": "float32", "grad": true}
                    {"t": "json", "v": <encoded>}    ints, floats, bools, None, tuples/lists,
                                                     torch.Size, torch.dtype, torch.device
    tensors         the tensor values, in order, with the shapes/dtypes the header announced

So nothing about shapes is hard-coded and a boundary may carry any number of values. Small
Python values travel inside the header as JSON - never pickle. Every wait has a timeout; a
failure is turned into a `PeerError` by the caller (see `health.py`), which names the dead rank.
Messages between one pair of ranks on one tag are matched in order, which is why schedules keep
microbatches in increasing order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from model_parallel.errors import PeerError

TAG_ACTIVATION = 1
TAG_GRADIENT = 2
TAG_MIGRATION = 3

_MAX_HEADER = 64 << 20  # a header larger than this is garbage, not a boundary description
SLOT_BYTES = 1024  # fixed first transfer: length + the start of the header
_SLOT_ROOM = SLOT_BYTES - 8


# ---- encoding small values ---------------------------------------------------------------------
def encode_value(value: Any) -> Any:
    """A JSON form of a non-tensor boundary value (see module docstring for what is allowed)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    raise PeerError(f"cannot send a value of type {type(value).__name__} between stages "
                    "(allowed: tensors, int, float, bool, str, None, tuple/list of them, torch.Size, dtype, device)")


def decode_value(data: Any, device: Optional[torch.device] = None) -> Any:
    """Inverse of `encode_value`; a device is re-localised to the receiver's `device`."""
    if isinstance(data, list):
        return [decode_value(v, device) for v in data]
    if isinstance(data, dict):
        if "size" in data:
            return torch.Size(data["size"])
        if "dtype" in data:
            return getattr(torch, data["dtype"])
        if "device" in data:
            return device if device is not None else torch.device("cpu")
        if "tuple" in data:
            return tuple(decode_value(v, device) for v in data["tuple"])
    return data


def make_header(values: list[Any]) -> list[dict[str, Any]]:
    header = []
    for value in values:
        if isinstance(value, torch.Tensor):
            header.append({"t": "tensor", "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                           "grad": bool(value.requires_grad)})
        else:
            header.append({"t": "json", "v": encode_value(value)})
    return header


# ---- sending / receiving -------------------------------------------------------------------------
@dataclass
class SendHandle:
    """Outstanding isends of one message; keep the buffers alive until `wait`."""

    works: list[Any]
    buffers: list[torch.Tensor]
    peer: int

    def wait(self, timeout: float) -> None:
        for work in self.works:
            wait_work(work, timeout, self.peer, "send")
        self.works.clear()
        self.buffers.clear()


def wait_work(work: Any, timeout: float, peer: int, what: str) -> None:
    """Wait for a torch.distributed work handle; failure or timeout becomes a PeerError (peer -1: a collective)."""
    try:
        ok = work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        raise PeerError(f"{what} with rank {peer} failed: {str(error).splitlines()[0][:200]}") from error
    if ok is False:
        raise PeerError(f"{what} with rank {peer} timed out after {timeout:.0f} s")


def send_values(values: list[Any], dst: int, tag: int, group: Any = None, device: Optional[torch.device] = None) -> SendHandle:
    """Start sending `values` to rank `dst` (non-blocking); returns a handle to wait on."""
    device = device or torch.device("cpu")
    header = json.dumps(make_header(values), separators=(",", ":")).encode()
    slot = bytearray(SLOT_BYTES)
    slot[:8] = len(header).to_bytes(8, "little")
    head = header[:_SLOT_ROOM]
    slot[8:8 + len(head)] = head
    buffers = [torch.frombuffer(slot, dtype=torch.uint8).to(device)]
    if len(header) > _SLOT_ROOM:
        buffers.append(torch.frombuffer(bytearray(header[_SLOT_ROOM:]), dtype=torch.uint8).to(device))
    buffers += [v.detach().contiguous() for v in values if isinstance(v, torch.Tensor)]
    works = [dist.isend(b, dst, group=group, tag=tag) for b in buffers]
    return SendHandle(works, buffers, dst)


class PendingRecv:
    """A message being received from `src`: the header slot is posted at construction (so it can
    land while we compute); `wait()` completes the header and receives the tensors."""

    def __init__(self, src: int, tag: int, group: Any = None, device: Optional[torch.device] = None) -> None:
        self.src, self.tag, self.group = src, tag, group
        self.device = device or torch.device("cpu")
        self.slot = torch.empty(SLOT_BYTES, dtype=torch.uint8, device=self.device)
        self.work = dist.irecv(self.slot, src, group=group, tag=tag)

    def wait(self, timeout: float) -> list[Any]:
        wait_work(self.work, timeout, self.src, "receive")
        slot = self.slot.cpu().numpy().tobytes()
        size = int.from_bytes(slot[:8], "little")
        if not 0 < size <= _MAX_HEADER:
            raise PeerError(f"rank {self.src} sent a message header of {size} bytes; expected 1..{_MAX_HEADER} "
                            "(are both ranks running the same plan and schedule?)")
        data = slot[8:8 + min(size, _SLOT_ROOM)]
        if size > _SLOT_ROOM:
            rest = torch.empty(size - _SLOT_ROOM, dtype=torch.uint8, device=self.device)
            wait_work(dist.irecv(rest, self.src, group=self.group, tag=self.tag), timeout, self.src, "receive")
            data += rest.cpu().numpy().tobytes()
        try:
            header = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise PeerError(f"rank {self.src} sent an unreadable message header ({error}); "
                            "are both ranks running the same version of model_parallel?") from None
        values: list[Any] = []
        works = []
        for entry in header:
            if entry["t"] == "tensor":
                tensor = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device=self.device)
                works.append(dist.irecv(tensor, self.src, group=self.group, tag=self.tag))
                values.append((tensor, entry["grad"]))
            else:
                values.append((None, decode_value(entry["v"], self.device)))
        for work in works:
            wait_work(work, timeout, self.src, "receive")
        out = []
        for entry, (tensor, extra) in zip(header, values):
            if entry["t"] == "tensor":
                out.append(tensor.requires_grad_(bool(extra)) if tensor.is_floating_point() else tensor)
            else:
                out.append(extra)
        return out


def recv_values(src: int, tag: int, timeout: float, group: Any = None, device: Optional[torch.device] = None) -> list[Any]:
    return PendingRecv(src, tag, group, device).wait(timeout)


def broadcast_json(data: Optional[str], src: int, group: Any, timeout: float,
                   on_error: Optional[Callable[[Exception], None]] = None) -> str:
    """Broadcast a JSON string from `src` to every rank of `group` (length, then bytes)."""
    is_src = dist.get_rank() == src
    payload = (data or "").encode() if is_src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    wait_work(dist.broadcast(length, src, group=group, async_op=True), timeout, src, "control broadcast")
    if is_src and payload:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    if buffer.numel():
        wait_work(dist.broadcast(buffer, src, group=group, async_op=True), timeout, src, "control broadcast")
    return payload.decode() if is_src else buffer.numpy().tobytes().decode()
