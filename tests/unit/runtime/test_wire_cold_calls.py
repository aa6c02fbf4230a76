"""The cached message path (runtime/wire/comm.py, "Cold calls") over an in-process loopback transport: exact values
through header changes and receives posted ahead, spare send buffers reused only after a completed send, and the
torch calls a steady-state message makes (a send: one copy_ per tensor; a receive's wait: none)."""
from __future__ import annotations

import ctypes
from collections import defaultdict
from typing import Any, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model_parallel.errors import PeerError
from model_parallel.runtime.wire import comm


class _Work:
    def __init__(self, done: Any) -> None:
        self.done = done

    def wait(self, timeout: Any = None) -> bool:
        return self.done()


class Loopback:
    """gloo's matching on one pair in one process: the k-th receive posted on a tag gets the k-th send on it,
    of the same size. A send's bytes are read when it is waited (or received), as late as gloo may read them,
    so a buffer reused before its send completed would show up as a wrong value."""

    def __init__(self) -> None:
        self.sends: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.posted: dict[int, int] = defaultdict(int)
        self.fail_sends = False

    def isend(self, buffer: torch.Tensor, dst: int, group: Any, tag: int) -> _Work:
        entry: dict[str, Any] = {"buffer": buffer, "bytes": None}
        self.sends[tag].append(entry)

        def done() -> bool:
            if self.fail_sends:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
            self._capture(entry)
            return True
        return _Work(done)

    @staticmethod
    def _capture(entry: dict[str, Any]) -> bytes:
        if entry["bytes"] is None:
            buffer = entry["buffer"]
            entry["bytes"] = ctypes.string_at(buffer.data_ptr(), buffer.numel())
        return entry["bytes"]

    def irecv(self, buffer: torch.Tensor, src: int, group: Any, tag: int) -> _Work:
        index = self.posted[tag]
        self.posted[tag] += 1

        def done() -> bool:
            data = self._capture(self.sends[tag][index])
            assert len(data) == buffer.numel(), f"gloo would refuse: {len(data)} bytes into {buffer.numel()}"
            ctypes.memmove(buffer.data_ptr(), data, len(data))  # not a torch call, as gloo's write is not
            return True
        return _Work(done)


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Loopback:
    loop = Loopback()
    monkeypatch.setattr(comm, "_isend", loop.isend)
    monkeypatch.setattr(comm, "_irecv", loop.irecv)
    return loop


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _value(i: int, rows: int = 2) -> torch.Tensor:
    return torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16) + 100 * i


def test_steady_state_reuses_one_send_buffer_and_every_value_is_exact(wire: Loopback) -> None:
    send_cache, recv_cache = comm.HeaderCache(), comm.HeaderCache()
    pointers = []
    for i in range(5):
        pending = comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=recv_cache, stream=0)
        x = _value(i).requires_grad_()
        handle = comm.send_values([x, 7, torch.arange(3)], 1, comm.TAG_ACTIVATION, cache=send_cache, stream=0,
                                  structure={"list": [{"leaf": 0}, {"leaf": 1}, {"leaf": 2}]})
        pointers.append(handle.buffers[-1].data_ptr())
        handle.wait(5)
        got = pending.wait(5)
        assert torch.equal(got[0].detach(), x.detach()) and got[0].requires_grad and got[0].is_leaf, i
        assert got[1] == 7 and torch.equal(got[2], torch.arange(3)), i
        assert pending.structure == {"list": [{"leaf": 0}, {"leaf": 1}, {"leaf": 2}]}, i
    # message 0 announces the header; from message 1 on one spare buffer goes round
    assert len(set(pointers[1:])) == 1, pointers


def test_a_steady_send_makes_one_copy_per_tensor_and_a_receive_wait_no_torch_call(wire: Loopback) -> None:
    send_cache, recv_cache = comm.HeaderCache(), comm.HeaderCache()
    for i in range(3):  # header announced, then a spare buffer exists
        pending = comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=recv_cache, stream=0)
        comm.send_values([_value(i).requires_grad_()], 1, comm.TAG_ACTIVATION, cache=send_cache, stream=0).wait(5)
        pending.wait(5)
    pending = comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=recv_cache, stream=0)
    x = _value(9).requires_grad_()
    with _Ops() as sent:
        handle = comm.send_values([x], 1, comm.TAG_ACTIVATION, cache=send_cache, stream=0)
    handle.wait(5)
    with _Ops() as received:
        got = pending.wait(5)
    assert sent.ops == ["aten.detach.default", "aten.copy_.default"], sent.ops  # detach: x requires grad
    assert received.ops == [], received.ops
    assert torch.equal(got[0].detach(), x.detach()) and got[0].requires_grad


def test_headers_that_change_under_receives_posted_ahead_arrive_exact(wire: Loopback) -> None:
    """As tests/integration/test_comm_ahead.py over gloo: three receives ahead, even streams change shape."""
    send_cache, recv_cache = comm.HeaderCache(), comm.HeaderCache()
    messages = [(r, s) for r in range(4) for s in range(4)]

    def value(r: int, s: int) -> torch.Tensor:
        return _value(r + 10 * s, rows=2 + (r % 3 if s % 2 == 0 else 0))
    handles = [comm.send_values([value(r, s), f"r{r}s{s}"], 1, comm.TAG_ACTIVATION, cache=send_cache, stream=s)
               for r, s in messages]
    pending: list[comm.PendingRecv] = []
    for i, (r, s) in enumerate(messages):
        while len(pending) < 3 and len(pending) + i < len(messages):
            pending.append(comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=recv_cache,
                                            stream=messages[i + len(pending)][1]))
        got = pending.pop(0).wait(5)
        assert torch.equal(got[0], value(r, s)) and got[1] == f"r{r}s{s}", (r, s, got)
    for handle in handles:
        handle.wait(5)


def test_a_failed_send_keeps_its_buffer_out_of_the_spares(wire: Loopback) -> None:
    cache = comm.HeaderCache()
    comm.send_values([_value(0)], 1, comm.TAG_ACTIVATION, cache=cache, stream=0).wait(5)
    known = cache.sent[(1, comm.TAG_ACTIVATION, 0)]
    assert len(known.spare) == 1
    handle = comm.send_values([_value(1)], 1, comm.TAG_ACTIVATION, cache=cache, stream=0)
    assert known.spare == []  # taken by the message in flight
    wire.fail_sends = True
    with pytest.raises(PeerError, match="send with rank 1 failed: Connection closed"):
        handle.wait(5)
    assert known.spare == []  # gloo may still read it: never handed to another message


def test_large_messages_and_widened_values_take_the_plain_path(wire: Loopback) -> None:
    send_cache, recv_cache = comm.HeaderCache(), comm.HeaderCache()
    big = torch.randn(comm.SPARE_BYTES // 2 + 1)  # over SPARE_BYTES as bf16 too
    for wire_dtype in (None, None, torch.bfloat16, torch.bfloat16):
        pending = comm.PendingRecv(0, comm.TAG_GRADIENT, cache=recv_cache, stream=0)
        comm.send_values([big], 1, comm.TAG_GRADIENT, cache=send_cache, stream=0, wire_dtype=wire_dtype).wait(5)
        got = pending.wait(5)[0]
        want = big if wire_dtype is None else big.to(torch.bfloat16).float()
        assert got.dtype == torch.float32 and torch.equal(got, want), wire_dtype
        assert send_cache.sent[(1, comm.TAG_GRADIENT, 0)].spare == []  # over SPARE_BYTES: not kept
