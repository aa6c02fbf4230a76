"""A live stage state (`--redundancy 1`) arrives from another rank as bytes (runtime/checkpoint/live.py): a JSON
header and raw tensor bytes. Whatever those bytes are, `decode` returns the state or one CheckpointError naming the
source - an empty tensor path was an IndexError, a list of scalars an AttributeError, both tracebacks."""
from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch

from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint.live import StageState, decode, encode


def _state() -> StageState:
    return StageState(4, 1, (1,), 0, ((0,), (1,)), {"fc.weight": torch.arange(6.0).reshape(2, 3)},
                      {"bn.running_mean": torch.zeros(3)}, {"fc.weight": {"momentum_buffer": torch.ones(2, 3), "step": 4}},
                      {"world": 2})


def _with_header(change: Any) -> bytes:
    data = encode(_state())
    (length,) = struct.unpack_from("<Q", data) if len(data) >= 8 else (0,)
    head = json.loads(data[8:8 + length])
    change(head)
    text = json.dumps(head).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length:]


def test_a_state_reads_back() -> None:
    state = decode(encode(_state()), "rank 1's state")
    assert torch.equal(state.params["fc.weight"], torch.arange(6.0).reshape(2, 3))
    assert state.optimizer["fc.weight"]["step"] == 4 and torch.equal(state.optimizer["fc.weight"]["momentum_buffer"],
                                                                    torch.ones(2, 3))


HOSTILE = {
    "empty tensor path": lambda h: h["tensors"][0].__setitem__(0, []),
    "path a string": lambda h: h["tensors"][0].__setitem__(0, "params"),
    "unknown section": lambda h: h["tensors"][0].__setitem__(0, ["grads", "fc.weight"]),
    "optimizer path too short": lambda h: h["tensors"][0].__setitem__(0, ["optimizer", "fc.weight"]),
    "scalars a list": lambda h: h.__setitem__("scalars", [1, 2]),
    "negative size": lambda h: h["tensors"][0].__setitem__(4, -8),
    "offset past the body": lambda h: h["tensors"][0].__setitem__(3, 1 << 40),
    "shape of 2^62": lambda h: h["tensors"][0].__setitem__(2, [1 << 62]),
    "dtype a function": lambda h: h["tensors"][0].__setitem__(1, "load"),
    "tensors not a list": lambda h: h.__setitem__("tensors", 5),
    "step a string": lambda h: h.__setitem__("step", "x"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_state_is_a_checkpoint_error(name: str) -> None:
    with pytest.raises(CheckpointError, match="rank 1's state"):
        decode(_with_header(HOSTILE[name]), "rank 1's state")


@pytest.mark.parametrize("data", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00[", struct.pack("<Q", 1 << 60) + b"{}",
                                  struct.pack("<Q", 2) + b"[]"])
def test_hostile_bytes_are_a_checkpoint_error(data: bytes) -> None:
    with pytest.raises(CheckpointError, match="rank 1's state"):
        decode(data, "rank 1's state")
