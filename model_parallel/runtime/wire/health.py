"""Heartbeats in the rendezvous store, so a rank whose communication fails can name the dead peer.

Every rank's background thread writes `mp/hb/<rank>` = wall-clock time every `interval` seconds.
When a send/recv/collective fails or times out, `diagnose` finds the culprit:

1. a rank that already diagnosed a failure wrote `mp/status/<rank>` = {"state": "failed", "blame": r};
   its blame is reused, so every survivor names the same root cause (not the rank that exited
   because of it);
2. otherwise the heartbeats are sampled twice, `3 * interval` (at most a quarter of the timeout)
   apart; a rank whose heartbeat did not move (and that did not finish normally) stopped responding;
3. if the store itself is unreachable, the rank hosting it (rank 0 / the torchrun agent) is gone.

Each rank also writes the step its training runs to (`mp/steps/<rank>`, at the start of `train`): ranks
started with different `--steps` wait on each other after the shorter run's last step with every peer
alive, which the diagnosis names as such (raising --timeout, the advice for a slow peer, would not help).

Before all that, a rank checks whether *it* stood still: its heartbeat thread notes when a wait of
`interval` seconds ended much later (SIGSTOP, a debugger, a paused VM: the monotonic clock runs on
while the process does not). A rank that stood still for half the peers' timeout or more is the
one its peers gave up on, so it names itself instead of the peers that left without it.

Time. A peer's wait ends after `--timeout` (T); the diagnosis then has a budget of 0.4 T in all,
and each store call at most 0.15 T of it (a live store answers in milliseconds): every rank ends
within about 1.4 T of the failure. A cut network link sends no reset, and TCPStore's
`check`/`get` then wait forever, so each call runs in a daemon thread that is abandoned at its
deadline (the process exits soon after, with the store host named as unreachable).

The result is a `PeerError` such as "rank 2 stopped responding (last heartbeat 3.4 s ago)".
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from model_parallel.errors import PeerError

logger = logging.getLogger(__name__)

_HB = "mp/hb/{}"
_FOUND_BY = re.compile(r"\(found by rank \d+\)$")
_STATUS = "mp/status/{}"
_END_STEP = "mp/steps/{}"
DIAGNOSIS_SHARE = 0.4  # of the timeout: the whole diagnosis (so a rank ends within 1.4 x --timeout)
STORE_CALL_SHARE = 0.15  # of the timeout: one store call while diagnosing
SAMPLE_SHARE = 0.25  # of the timeout: at most this long between the two heartbeat samples
FROZEN_SHARE = 0.5  # of the timeout: standing still this long makes a rank the culprit of its peers' timeouts
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
        self.diagnosis_budget = max(1.0, DIAGNOSIS_SHARE * self.store_timeout)
        self._deadline: Optional[float] = None  # monotonic end of the running diagnosis' budget
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._waiting_since: Optional[float] = None  # monotonic start of the heartbeat thread's current wait
        self._frozen: tuple[float, float] = (0.0, 0.0)  # (seconds stood still, monotonic time it ended)
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

        limit = self.store_timeout
        if self._deadline is not None:  # diagnosing: within the budget, and no call may eat all of it
            limit = min(limit, max(0.5, STORE_CALL_SHARE * self.store_timeout), self._deadline - time.monotonic())
            if limit <= 0:
                self._store_dead = True
                raise StoreUnreachable(f"{what}: the store answered too slowly for the diagnosis' "
                                       f"{self.diagnosis_budget:.1f} s budget")
        thread = threading.Thread(target=target, name=f"store-call-{self.rank}", daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            self._store_dead = True  # the thread stays blocked; it is a daemon, so it cannot hold up the exit
            raise StoreUnreachable(f"{what} got no answer within {limit:.1f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def announce_end_step(self, end_step: int) -> None:
        """Publish the step this rank trains to (compared by the diagnosis); best effort: a store that does not
        answer now is diagnosed when communication fails."""
        try:
            self._bounded(lambda: self.store.set(_END_STEP.format(self.rank), str(int(end_step))), "publishing the end step")
        except Exception as error:  # noqa: BLE001 - the same store failure is diagnosed where it matters
            logger.debug("rank %d: end step not published: %s", self.rank, error)

    def _different_ends(self) -> Optional[str]:
        """'rank 0 trains to step 10, rank 1 to step 20' when the published end steps differ, else None."""
        ends = {}
        for r in range(self.world_size):
            text = self._read(_END_STEP.format(r))
            if text and text.isdigit():
                ends[r] = int(text)
        if len(set(ends.values())) < 2:
            return None
        return ", ".join(f"rank {r} trains to step {end}" for r, end in sorted(ends.items()))

    def _run(self) -> None:
        while True:
            self._waiting_since = started = time.monotonic()
            if self._stop.wait(self.interval):
                return
            self._waiting_since = None
            late = time.monotonic() - started - self.interval
            if late > 2 * self.interval:  # this process stood still (not a blocked store call: that is below)
                self._frozen = (late, time.monotonic())
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
    def frozen_for(self) -> float:
        """Seconds this process recently stood still (see the module docstring); 0 if it did not."""
        now = time.monotonic()
        since = self._waiting_since
        late = now - since - self.interval if since is not None else 0.0  # still inside an overlong wait
        seconds, ended = self._frozen
        if now - ended <= 2 * self.store_timeout + seconds:  # recent enough to explain the failure at hand
            late = max(late, seconds)
        return max(late, 0.0)

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
        self._deadline = time.monotonic() + self.diagnosis_budget
        try:
            return self._diagnose(detail)
        finally:
            self._deadline = None

    def _diagnose(self, detail: str) -> PeerError:
        frozen = self.frozen_for()
        if frozen >= FROZEN_SHARE * self.store_timeout:
            # Its peers timed out waiting for this rank; blaming them (gone by now) would be wrong.
            return self._publish(self.rank, f"rank {self.rank} stopped responding: this process stood still for "
                                            f"{frozen:.1f} s (SIGSTOP, a debugger or an overloaded host) while its "
                                            f"peers wait at most {self.store_timeout:g} s (--timeout)", detail)
        try:
            reused = self._reuse(self._statuses(), detail)
            if reused is not None:
                return reused
            first = self._heartbeats()
            # A live rank beats at least twice in this window; bounded so the diagnosis fits its budget.
            time.sleep(min(3 * self.interval, SAMPLE_SHARE * self.store_timeout))
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
            different = self._different_ends()
            if different:
                return self._publish(None, f"the ranks were started with different step counts ({different}): one "
                                           "stopped after its last step while the others still needed it; give every "
                                           "worker the same --steps (PipelineTrainer.train(steps) on every rank)", detail)
            done = [r for r, s in statuses.items() if s.get("state") == "done"]
            if done:
                return self._publish(None, f"rank(s) {done} already finished while rank {self.rank} still needed them "
                                           "(do all ranks run the same --steps and plan?)", detail)
            return self._publish(None, "communication failed but every peer is still alive (slow peer? raise --timeout)", detail)
        except Exception as store_error:  # noqa: BLE001 - any store failure means its host is gone
            reason = str(store_error).splitlines()[0][:120] if str(store_error) else type(store_error).__name__
            if isinstance(store_error, MemoryError) or "can't start new thread" in reason:
                # This process's own limit (RLIMIT_DATA/AS counts thread stacks): the store may be fine.
                return PeerError(f"rank {self.rank} could not ask the rendezvous store who failed: this process is "
                                 f"out of memory itself ({reason}); raise its memory limit or lower "
                                 f"memory_per_worker; {detail}")
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
                cause = str(status.get("cause", ""))
                if not _FOUND_BY.search(cause):  # a reused cause keeps naming the rank that found it first
                    cause += f" (found by rank {reporter})"
                return self._publish(status["blame"], cause, detail)
        return None

    def _publish(self, culprit: Optional[int], cause: str, detail: str) -> PeerError:
        self.stop("failed", culprit, cause)
        return PeerError(f"{cause}; {detail}")
