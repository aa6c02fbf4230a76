"""A log that cannot be flooded: at most `burst` lines per key and `global_burst` in all per interval, the rest counted.

A peer that opens hundreds of connections a second would otherwise write hundreds of warnings a
second. `RateLimitedLog.log(level, key, message)` writes the first `burst` lines of a key at once
(a handful of events stay fully visible); further lines of the same key within `interval` seconds
are only counted, and the count is written with the next line of that key after the interval, or by
`flush()` (call it periodically) once the interval is over, e.g.
`unauthenticated clients from 10.0.0.7: 212 more like this in the last 10 s; the last: ...`.

Many keys (150 source addresses) would still write `burst` lines each: so all keys together write
at most `global_burst` lines per interval, summaries included; what is held beyond that is written
as one line per interval, e.g. `... 4210 more lines from 150 source(s) held in the last 10 s ...`.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

MAX_KEYS = 1024  # keys beyond this share one entry, so a flood from many addresses cannot grow memory


@dataclass
class _Entry:
    since: float
    written: int = 1
    held: int = 0
    level: int = logging.WARNING
    last: str = ""


@dataclass
class _Window:
    """All keys together within one interval: lines written, and the lines held beyond `global_burst`."""

    since: float
    written: int = 0
    held: int = 0
    keys: set[str] = field(default_factory=set)
    level: int = logging.WARNING
    last: str = ""


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0, burst: int = 5,
                 clock: Callable[[], float] = time.monotonic, global_burst: int = 30) -> None:
        self.logger, self.interval, self.burst, self.clock = logger, interval, burst, clock
        self.global_burst = global_burst
        self._entries: dict[str, _Entry] = {}
        self._window = _Window(since=clock())
        self._lock = threading.Lock()

    def _admit(self, level: int, key: str, message: str, count: int) -> bool:
        """Within the global budget: take one line of it (True); else hold `count` lines (lock held)."""
        if self._window.written < self.global_burst:
            self._window.written += 1
            return True
        self._window.held += count
        self._window.keys.add(key)
        self._window.level, self._window.last = level, message
        return False

    def _roll(self, now: float) -> list[tuple[int, str]]:
        """Start a new global window once the interval is over; the held lines' summary, if any (lock held)."""
        window = self._window
        if now - window.since < self.interval:
            return []
        self._window = _Window(since=now)
        if not window.held:
            return []
        return [(window.level, f"{window.held} more line(s) from {len(window.keys)} source(s) held in the last "
                               f"{now - window.since:.0f} s (at most {self.global_burst} lines per {self.interval:g} s "
                               f"in all); the last: {window.last}")]

    def log(self, level: int, key: str, message: str) -> bool:
        """Write `message` now (True) or count it against `key` (False)."""
        with self._lock:
            now = self.clock()
            summary = self._roll(now)
            if key not in self._entries and len(self._entries) >= MAX_KEYS:
                key = "other sources"
            entry = self._entries.get(key)
            if entry is not None and now - entry.since < self.interval:
                if entry.written >= self.burst:
                    entry.held, entry.level, entry.last = entry.held + 1, level, message
                    admitted = False
                else:
                    entry.written += 1
                    held = 0
                    admitted = self._admit(level, key, message, 1)
            else:
                held = entry.held if entry is not None else 0
                self._entries[key] = _Entry(since=now)
                admitted = self._admit(level, key, message, 1 + held)
        for line_level, line in summary:
            self.logger.log(line_level, "%s", line)
        if not admitted:
            return False
        self.logger.log(level, "%s%s", message, f" (and {held} more like this since the last such line)" if held else "")
        return True

    def flush(self) -> int:
        """Write the count of every key whose interval is over; returns the number of summary lines."""
        lines = []
        with self._lock:
            now = self.clock()
            lines.extend(self._roll(now))
            for key, entry in list(self._entries.items()):
                if now - entry.since >= self.interval:
                    del self._entries[key]  # keeps memory bounded by the keys active in one interval
                    line = f"{key}: {entry.held} more like this in the last {now - entry.since:.0f} s; the last: {entry.last}"
                    if entry.held and self._admit(entry.level, key, line, entry.held):
                        lines.append((entry.level, line))
        for level, line in lines:
            self.logger.log(level, "%s", line)
        return len(lines)
