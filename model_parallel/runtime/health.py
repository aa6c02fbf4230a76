"""Heartbeats in the rendezvous store, so a rank whose communication fails can name the dead peer.

Every rank's background thread writes `mp/hb/<rank>` = wall-clock time every `interval` seconds.
When a send/recv/collective fails or times out, `diagnose` finds the culprit:

1. a rank that already diagnosed a failure wrote `mp/status/<rank>` = {"state": "failed", "blame": r};
   its blame is reused, so every survivor names the same root cause (not the rank that exited
   because of it);
2. otherwise the heartbeats are sampled twice, `3 * interval` apart; a rank whose heartbeat did
   not move (and that did not finish normally) stopped responding;
3. if the store itself is unreachable, the rank hosting it (rank 0 / the torchrun agent) is gone.

Every store call made here is bounded by `store_timeout`: a cut network link sends no reset, and
TCPStore's `check`/`get` then wait forever, so each call runs in a daemon thread that is abandoned
at the deadline (the process exits soon after, with the store host named as unreachable).

The result is a `PeerError` such as "rank 2 stopped responding (last heartbeat 3.4 s ago)".
"""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from model_parallel.errors import PeerError

logger = logging.getLogger(__name__)

_HB = "mp/hb/{}"
_STATUS = "mp/status/{}"
_T = TypeVar("_T")


class StoreUnreachable(Exception):
    """A store call did not return within the deadline (internal to this module)."""


class Health:
    """One rank's heartbeat writer and failure diagnostician."""

    def __init__(self, store: Any, rank: int, world_size: int, interval: float = 1.0, store_host: Optional[int] = 0,
                 store_timeout: Optional[float] = None, store_address: str = "") -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval = interval
        self.store_host = store_host
        self.store_address = store_address  # "host:port", for messages only
        self.store_timeout = store_timeout if store_timeout is not None else max(5.0, 3 * interval)
        self._store_dead = False  # a call timed out: later calls fail at once instead of waiting again
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:
            store.set_timeout(timedelta(seconds=self.store_timeout))
        except Exception:  # noqa: BLE001 - PrefixStore wrappers may not expose it; their default is fine
            pass

    def start(self) -> "Health":
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        self.store.set(_HB.format(self.rank), f"{time.time():.3f}")

    def _bounded(self, call: Callable[[], _T], what: str) -> _T:
        """Run one store call with the `store_timeout` deadline (see the module docstring)."""
        if self._store_dead:
            raise StoreUnreachable(f"{what}: the store did not answer earlier calls")
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = call()
            except BaseException as error:  # noqa: BLE001 - handed to the caller below
                box["error"] = error

        thread = threading.Thread(target=target, name=f"store-call-{self.rank}", daemon=True)
        thread.start()
        thread.join(self.store_timeout)
        if thread.is_alive():
            self._store_dead = True  # the thread stays blocked; it is a daemon, so it cannot hold up the exit
            raise StoreUnreachable(f"{what} got no answer within {self.store_timeout:.1f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception as error:  # noqa: BLE001 - the store host died; diagnose() reports it
                logger.debug("rank %d: heartbeat failed: %s", self.rank, error)
                return

    def stop(self, state: str = "done", blame: Optional[int] = None, message: str = "") -> None:
        """Stop beating and publish why (`done` for a normal exit, `failed` with the blamed rank).
        Only the first call publishes, so a diagnosis is not overwritten by a later generic failure."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread() and not self._store_dead:
            # No heartbeat may be mid-call when the process exits (a store error thrown in a daemon thread
            # during interpreter shutdown aborts the process); a live store answers in milliseconds.
            self._thread.join(min(self.store_timeout, 2 * self.interval + 1.0))
        status = json.dumps({"state": state, "blame": blame, "cause": message})
        try:
            self._bounded(lambda: self.store.set(_STATUS.format(self.rank), status), "publishing the status")
        except Exception:  # noqa: BLE001 - store gone: nothing to publish to
            pass

    def linger(self, max_seconds: float, blamed: Optional[int] = None) -> None:
        """On the rank hosting the store: after a failure, keep the store up until every other live
        rank has published its status (or `max_seconds` pass), so they can still name the culprit."""
        deadline = time.monotonic() + max_seconds
        while time.monotonic() < deadline:
            try:
                statuses = self._statuses()
            except Exception:  # noqa: BLE001
                return
            waiting = [r for r in range(self.world_size) if r not in statuses and r != self.rank and r != blamed]
            if not waiting:
                return
            time.sleep(0.2)

    # ---- diagnosis ---------------------------------------------------------------------------------
    def _read(self, key: str) -> Optional[str]:
        if not self._bounded(lambda: self.store.check([key]), f"store check of {key!r}"):
            return None
        return self._bounded(lambda: self.store.get(key), f"store get of {key!r}").decode()

    def _statuses(self) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(self.world_size):
            text = self._read(_STATUS.format(r))
            if text:
                out[r] = json.loads(text)
        return out

    def _heartbeats(self) -> dict[int, float]:
        out = {}
        for r in range(self.world_size):
            text = self._read(_HB.format(r))
            if text:
                out[r] = float(text)
        return out

    def diagnose(self, error: BaseException) -> PeerError:
        """Name the rank that caused `error` (see module docstring); returns the PeerError to raise."""
        detail = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        try:
            reused = self._reuse(self._statuses(), detail)
            if reused is not None:
                return reused
            first = self._heartbeats()
            time.sleep(3 * self.interval)  # a live rank beats at least twice in this window
            second = self._heartbeats()
            statuses = self._statuses()
            reused = self._reuse(statuses, detail)
            if reused is not None:
                return reused
            failed = [(r, s.get("cause", "")) for r, s in statuses.items()
                      if s.get("state") == "failed" and s.get("blame") is None and r != self.rank]
            if failed:
                culprit, why = failed[0]
                return self._publish(culprit, f"rank {culprit} failed: {why[:300]}", detail)
            stale = [r for r in range(self.world_size)
                     if r != self.rank and statuses.get(r, {}).get("state") != "done"
                     and (r not in second or first.get(r) == second.get(r))]
            if stale:
                culprit = min(stale, key=lambda r: second.get(r, 0.0))  # the one silent for longest
                age = time.time() - second[culprit] if culprit in second else float("nan")
                return self._publish(culprit, f"rank {culprit} stopped responding (last heartbeat {age:.1f} s ago)", detail)
            done = [r for r, s in statuses.items() if s.get("state") == "done"]
            if done:
                return self._publish(None, f"rank(s) {done} already finished while rank {self.rank} still needed them "
                                           "(do all ranks run the same --steps and plan?)", detail)
            return self._publish(None, "communication failed but every peer is still alive (slow peer? raise --timeout)", detail)
        except Exception as store_error:  # noqa: BLE001 - any store failure means its host is gone
            reason = str(store_error).splitlines()[0][:120] if str(store_error) else type(store_error).__name__
            self._store_dead = True  # do not wait on it again when publishing this rank's status
            where = f" at {self.store_address}" if self.store_address else ""
            if self.store_host is None:
                return PeerError(f"the rendezvous store{where} (torchrun's agent) is unreachable: {reason}; {detail}")
            return PeerError(f"rank {self.store_host} stopped responding (it hosts the rendezvous store{where}, which is "
                             f"unreachable: {reason}); {detail}")

    def _reuse(self, statuses: dict[int, dict[str, Any]], detail: str) -> Optional[PeerError]:
        """Another rank already named a culprit (not us): report the same root cause."""
        for reporter, status in sorted(statuses.items()):
            if status.get("state") == "failed" and status.get("blame") not in (None, self.rank) and reporter != self.rank:
                return self._publish(status["blame"], f"{status.get('cause', '')} (found by rank {reporter})", detail)
        return None

    def _publish(self, culprit: Optional[int], cause: str, detail: str) -> PeerError:
        self.stop("failed", culprit, cause)
        return PeerError(f"{cause}; {detail}")
