"""A log that cannot be flooded: at most `burst` lines per key per interval, the rest counted and summarised.

A peer that opens hundreds of connections a second would otherwise write hundreds of warnings a
second. `RateLimitedLog.log(level, key, message)` writes the first `burst` lines of a key at once
(a handful of events stay fully visible); further lines of the same key within `interval` seconds
are only counted, and the count is written with the next line of that key after the interval, or by
`flush()` (call it periodically) once the interval is over, e.g.
`unauthenticated clients from 10.0.0.7: 212 more like this in the last 10 s; the last: ...`.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

MAX_KEYS = 1024  # keys beyond this share one entry, so a flood from many addresses cannot grow memory


@dataclass
class _Entry:
    since: float
    written: int = 1
    held: int = 0
    level: int = logging.WARNING
    last: str = ""


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0, burst: int = 5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval, self.burst, self.clock = logger, interval, burst, clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, message: str) -> bool:
        """Write `message` now (True) or count it against `key` (False)."""
        with self._lock:
            now = self.clock()
            if key not in self._entries and len(self._entries) >= MAX_KEYS:
                key = "other sources"
            entry = self._entries.get(key)
            if entry is not None and now - entry.since < self.interval:
                if entry.written >= self.burst:
                    entry.held, entry.level, entry.last = entry.held + 1, level, message
                    return False
                entry.written += 1
                held = 0
            else:
                held = entry.held if entry is not None else 0
                self._entries[key] = _Entry(since=now)
        self.logger.log(level, "%s%s", message, f" (and {held} more like this since the last such line)" if held else "")
        return True

    def flush(self) -> int:
        """Write the count of every key whose interval is over; returns the number of summary lines."""
        lines = []
        with self._lock:
            now = self.clock()
            for key, entry in list(self._entries.items()):
                if now - entry.since >= self.interval:
                    del self._entries[key]  # keeps memory bounded by the keys active in one interval
                    if entry.held:
                        lines.append((entry.level, f"{key}: {entry.held} more like this in the last "
                                                   f"{now - entry.since:.0f} s; the last: {entry.last}"))
        for level, line in lines:
            self.logger.log(level, "%s", line)
        return len(lines)
