"""How long this process stood still (SIGSTOP, a debugger, a paused VM), watched by a thread: the rule of
wire/health.py, for the recovery's meetings (recovery.py), where a process that stood still may have been left
behind by its peers."""
from __future__ import annotations

import threading
import time


class Stillness:
    """How long this process stood still (SIGSTOP, a debugger, a paused VM) while it ran: a thread's waits of
    `interval` seconds that ended much later (the monotonic clock runs on while the process does not; the rule of
    wire/health.py). The wait still running when `stop` is called counts too: the main thread may get there first.
    CPU time used meanwhile is no stand-still (a long `gc.collect()` holding the GIL starves the ticker too)."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval, self.longest = interval, 0.0
        self._since, self._cpu_since = time.monotonic(), time.process_time()
        self._done = threading.Event()

    def start(self) -> "Stillness":
        threading.Thread(target=self._run, name="recovery-stillness", daemon=True).start()
        return self

    def _run(self) -> None:
        while True:
            self._since, self._cpu_since = time.monotonic(), time.process_time()
            if self._done.wait(self.interval):
                return
            self.longest = max(self.longest, self._gap())

    def _gap(self) -> float:
        return time.monotonic() - self._since - self.interval - (time.process_time() - self._cpu_since)

    def now(self) -> float:
        """The longest stand-still seen so far, in seconds (watching goes on)."""
        return max(self.longest, self._gap())

    def stop(self) -> float:
        """Stop watching; the longest stand-still seen, in seconds."""
        self._done.set()
        return self.now()
