"""A message header is a peer's bytes (runtime/wire/comm.py): whatever it holds, the receive is the values it
describes or one PeerError naming the sender - never another torch attribute handed to the stage as a value
(`{"dtype": "load"}` was torch.load, `"os"` the os module), never a torch.empty of 2^62 elements (a RuntimeError),
never a KeyError or TypeError. The receive path runs in-process: gloo's receives are replaced by a fake that
fills the posted buffer with the bytes a hostile peer sent."""
from __future__ import annotations

import json
from collections import deque
from typing import Any

import pytest
import torch

from model_parallel.errors import PeerError
from model_parallel.runtime.wire import comm
from model_parallel.runtime.wire.packed import ALIGN, HeaderCache, parse_header
from model_parallel.runtime.wire.structure import decode_value, make_header

TENSOR = {"t": "tensor", "shape": [2, 3], "dtype": "float32", "grad": False}
HOSTILE: dict[str, Any] = {
    "dtype names torch.load": [{"t": "json", "v": {"dtype": "load"}}],
    "dtype names the os module": [{"t": "json", "v": {"dtype": "os"}}],
    "dtype a dunder": [{"t": "json", "v": {"dtype": "__builtins__"}}],
    "dtype not a string": [{"t": "json", "v": {"dtype": ["float32"]}}],
    "size of strings": [{"t": "json", "v": {"size": ["a"]}}],
    "size not a list": [{"t": "json", "v": {"size": 5}}],
    "unknown value kind": [{"t": "json", "v": {"module": "os"}}],
    "two keys in a value": [{"t": "json", "v": {"dtype": "float32", "size": [1]}}],
    "tuple not a list": [{"t": "json", "v": {"tuple": 3}}],
    "value nested deep": [{"t": "json", "v": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}],
    "tensor dtype torch.load": [{**TENSOR, "dtype": "load"}],
    "cast names a function": [{**TENSOR, "cast": "save"}],
    "shape of 2^62 elements": [{**TENSOR, "shape": [1 << 31, 1 << 31]}],
    "shape of 2^62 in one dimension": [{**TENSOR, "shape": [1 << 62]}],
    "shape with a negative dimension": [{**TENSOR, "shape": [-1, 3]}],
    "shape of floats": [{**TENSOR, "shape": [2.5]}],
    "shape of bools": [{**TENSOR, "shape": [True]}],
    "shape of 100 dimensions": [{**TENSOR, "shape": [1] * 100}],
    "shape missing": [{"t": "tensor", "dtype": "float32", "grad": False}],
    "grad missing": [{"t": "tensor", "shape": [1], "dtype": "float32"}],
    "entry not an object": ["tensor"],
    "unknown entry kind": [{"t": "pickle", "v": "x"}],
    "unknown key": [{**TENSOR, "storage": "/dev/zero"}],
    "json entry without a value": [{"t": "json"}],
    "header not a list": {"t": "tensor"},
    "many small tensors past the bound": [{**TENSOR, "shape": [1 << 30, 1 << 9]}] * 3,
    # A layout is viewed over the packed buffer (as_strided): only one that covers exactly the tensor's elements.
    "strides that overlap": [{**TENSOR, "stride": [1, 1]}],
    "strides that leave gaps (past the tensor's bytes)": [{**TENSOR, "stride": [1, 4]}],
    "strides reaching past the buffer": [{**TENSOR, "stride": [1 << 40, 1]}],
    "strides of another rank": [{**TENSOR, "stride": [1]}],
    "negative strides": [{**TENSOR, "stride": [-3, 1]}],
    "strides of bools": [{**TENSOR, "stride": [True, True]}],
    "strides not a list": [{**TENSOR, "stride": "3,1"}],
}
RAW: dict[str, bytes] = {
    "not UTF-8": b"\xff\xfe[]",
    "not JSON": b"[{",
    "a 5000-digit integer": b'[{"t": "json", "v": ' + b"9" * 5000 + b"}]",
    "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
}


class _Done:
    def wait(self, *args: Any) -> bool:
        return True


class FakePeer:
    """What a hostile rank 1 sent, transfer by transfer; each receive posted here takes the next one."""

    def __init__(self, transfers: list[bytes]) -> None:
        self.transfers = deque(transfers)

    def recv(self, buffer: torch.Tensor, *args: Any, **kwargs: Any) -> _Done:
        raw = buffer.view(-1).view(torch.uint8)
        data = self.transfers.popleft() if self.transfers else bytes(raw.numel())  # the tensors: zeros
        if data:
            raw[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return _Done()


@pytest.fixture
def peer(monkeypatch: pytest.MonkeyPatch) -> FakePeer:
    fake = FakePeer([])
    monkeypatch.setattr(comm, "_irecv", lambda buffer, src, group, tag: fake.recv(buffer))
    monkeypatch.setattr(comm.dist, "irecv", lambda buffer, *args, **kwargs: fake.recv(buffer))
    return fake


def _uncached(header: bytes) -> list[bytes]:
    """The transfers of a message without a cache: the 1024-byte slot (length + start of the header), the rest."""
    slot = len(header).to_bytes(8, "little") + header[:comm.SLOT_BYTES - 8]
    rest = header[comm.SLOT_BYTES - 8:]
    return [slot] + ([rest] if rest else [])


def _cached(header: bytes) -> list[bytes]:
    """The first cached message: a 16-byte placeholder whose prefix is the header's length, then the header."""
    return [len(header).to_bytes(8, "little") + bytes(ALIGN - 8), header]


def _receive(peer: FakePeer, transfers: list[bytes], cached: bool) -> list[Any]:
    peer.transfers.extend(transfers)
    pending = comm.PendingRecv(1, comm.TAG_ACTIVATION, cache=HeaderCache() if cached else None)
    return pending.wait(timeout=1.0)


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("name", [*HOSTILE, *RAW])
def test_a_hostile_header_is_a_peer_error_naming_the_sender(name: str, cached: bool, peer: FakePeer) -> None:
    data = RAW[name] if name in RAW else json.dumps(HOSTILE[name]).encode()
    with pytest.raises(PeerError, match="rank 1|message header") as caught:
        _receive(peer, (_cached if cached else _uncached)(data), cached)
    assert "model_parallel" in str(caught.value)  # the fix: the same version on both ranks


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
def test_an_honest_header_still_receives_its_values(cached: bool, peer: FakePeer) -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    values = [tensor, 3, float("inf"), None, "text", (1, [2.5]), torch.Size([4, 5]), torch.bfloat16,
              torch.device("cpu")]
    header = json.dumps(make_header(values), separators=(",", ":")).encode()
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    if cached:  # the packed buffer: the 16-byte prefix, then the tensor at offset 16
        transfers = _cached(header) + [bytes(ALIGN) + raw]
    else:
        transfers = _uncached(header) + [raw]
    out = _receive(peer, transfers, cached)
    assert torch.equal(out[0], tensor) and out[1:] == values[1:]


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
def test_a_transposed_value_arrives_with_its_strides(cached: bool, peer: FakePeer) -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(3, 2).t()  # strides (1, 2): travels in storage order
    header = json.dumps(make_header([tensor]), separators=(",", ":")).encode()
    raw = tensor.t().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    out = _receive(peer, _cached(header) + [bytes(ALIGN) + raw] if cached else _uncached(header) + [raw], cached)
    assert torch.equal(out[0], tensor) and out[0].stride() == (1, 2)


def test_decode_value_hands_over_no_torch_attribute() -> None:
    for name in ("load", "save", "os", "hub", "_C", "Tensor", "nn"):
        with pytest.raises(PeerError, match="not a torch dtype"):
            decode_value({"dtype": name})
    assert decode_value({"dtype": "float16"}) is torch.float16


def test_parse_header_accepts_what_make_header_writes() -> None:
    values = [torch.zeros(0, 4), torch.ones(3, dtype=torch.int64), 7, torch.Size([1])]
    header = make_header(values, {"list": [{"leaf": 0}, {"leaf": 1}, {"value": 7}, {"size": [1]}]}, torch.bfloat16)
    assert parse_header(json.dumps(header).encode(), 1) == header
