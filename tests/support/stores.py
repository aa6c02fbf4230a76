"""A dict standing in for the TCPStore calls the join protocol makes (tests of runtime/wire/join.py)."""
from __future__ import annotations


class DictStore:
    """The TCPStore calls the join protocol uses, on a dict (compare_set with TCPStore's semantics)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str) -> bytes:
        # Like TCPStore, `expected` may be bytes (what a get returned, UTF-8 or not).
        expected = expected if isinstance(expected, bytes) else expected.encode()
        current = self.data.get(key)
        if (current is None and expected == b"") or current == expected:
            self.data[key] = desired.encode()
            return desired.encode()
        return current if current is not None else expected
