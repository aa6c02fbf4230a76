"""The join keys in a job's store (runtime/wire/join.py) are written by whoever reaches the store: a joiner reads the
job's flags, its admission and the request slot. Garbage there is a ProtocolError naming the admission, or "no
flags"/"not ours" - never an OverflowError traceback (`"original": Infinity`), a RecursionError reported as a
store failure, or an admission whose port or rank is 10^9 handed on to the re-forming world."""
from __future__ import annotations

import json
from typing import Any

import pytest

from model_parallel.errors import ProtocolError
from model_parallel.runtime.wire import join

GOOD = {"nonce": "ab" * 16, "address": "10.0.0.5", "original": 2, "generation": 3, "members": [0, 1],
        "addresses": ["10.0.0.1", "10.0.0.2"], "base_port": 29500, "store_host": 0, "store_port": 29500}
DEEP = "[" * 100_000 + "]" * 100_000


class FakeStore:
    """The few TCPStore calls join.py makes, over a dict."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = {k: v.encode() if isinstance(v, str) else v for k, v in values.items()}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        assert self.check(keys)

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def compare_set(self, key: str, expected: Any, desired: str) -> bytes:
        expected = expected if isinstance(expected, bytes) else expected.encode()
        current = self.values.get(key, b"")
        if current == expected:
            self.values[key] = desired.encode()
        return self.values[key] if key in self.values else current


def test_an_honest_admission_reads_back() -> None:
    admission = join.Admission.from_json(json.dumps(GOOD))
    assert join.Admission.from_json(admission.to_json()) == admission
    assert admission.members == (0, 1) and admission.store_port == 29500


HOSTILE_ADMISSIONS = {
    "original Infinity": json.dumps(GOOD).replace('"original": 2', '"original": Infinity'),
    "generation 1e999": json.dumps(GOOD).replace('"generation": 3', '"generation": 1e999'),
    "generation a float": json.dumps({**GOOD, "generation": 2.7}),
    "original true": json.dumps({**GOOD, "original": True, "addresses": ["x"], "members": [0]}),
    "port 10^9": json.dumps({**GOOD, "base_port": 10 ** 9}),
    "store port 0": json.dumps({**GOOD, "store_port": 0}),
    "store host -1": json.dumps({**GOOD, "store_host": -1}),
    "rank 10^9": json.dumps({**GOOD, "original": 10 ** 9}),
    "generation 0": json.dumps({**GOOD, "generation": 0}),
    "members repeated": json.dumps({**GOOD, "members": [1, 1]}),
    "member above the joiner": json.dumps({**GOOD, "members": [0, 7]}),
    "member a string": json.dumps({**GOOD, "members": ["0", 1]}),
    "members an object": json.dumps({**GOOD, "members": {"0": 1}}),
    "address with a newline": json.dumps({**GOOD, "address": "10.0.0.5\nrank 0 failed"}),
    "address of 100 KB": json.dumps({**GOOD, "address": "a" * 100_000}),
    "nonce a number": json.dumps({**GOOD, "nonce": 7}),
    "a 5000-digit integer": json.dumps(GOOD).replace('"original": 2', '"original": ' + "9" * 5000),
    "nested 100000 deep": DEEP,
    "not an object": "[1, 2]",
    "not JSON": "{",
    "key missing": json.dumps({k: v for k, v in GOOD.items() if k != "store_port"}),
}


@pytest.mark.parametrize("name", HOSTILE_ADMISSIONS)
def test_a_hostile_admission_is_a_protocol_error(name: str) -> None:
    with pytest.raises(ProtocolError, match="admission"):
        join.Admission.from_json(HOSTILE_ADMISSIONS[name])


def test_wait_admission_reads_a_hostile_key_as_a_protocol_error() -> None:
    nonce = "cd" * 16
    store = FakeStore({join.ADMIT.format(nonce): HOSTILE_ADMISSIONS["original Infinity"]})
    with pytest.raises(ProtocolError, match="admission"):
        join.wait_admission(store, nonce, deadline=0.0)


@pytest.mark.parametrize("value", [DEEP, "\"" + "x" * 10 + "\"", "[1]", "{\"flags\": 3}", "9" * 5000, "\xff"])
def test_garbage_flags_are_no_published_flags(value: str) -> None:
    assert join.read_flags(FakeStore({join.FLAGS: value}), seconds=0.1) is None


def test_honest_flags_read_back() -> None:
    store = FakeStore({})
    join.publish_flags(store, {"steps": 5}, True, "gloo")
    assert join.read_flags(store, 0.1) == {"recover": True, "backend": "gloo", "flags": {"steps": 5}}


@pytest.mark.parametrize("value", [DEEP, "[1]", "9" * 5000, "\xff"])
def test_a_garbage_training_record_is_none_published(value: str) -> None:
    assert join.read_training(FakeStore({join.TRAINING: value}), seconds=0.1) is None


def test_the_training_record_reads_back() -> None:
    store = FakeStore({})
    join.publish_training(store, {"graph": "16 nodes, structure ab", "data_content": None})
    assert join.read_training(store, 0.1) == {"graph": "16 nodes, structure ab", "data_content": None}
    assert join.read_training(FakeStore({}), 0.1) is None  # an older job's rank 0: the checkpoint's record is used


def test_a_deeply_nested_request_slot_is_not_ours_and_is_freed() -> None:
    nonce = "ef" * 16
    store = FakeStore({join.REQUEST: DEEP})
    assert join.wait_admission(store, nonce, deadline=0.0) is None  # not ours: no RecursionError
    assert join.take_request(store) is None and store.values[join.REQUEST] == b""
