"""`--redundancy 1` (with `--recover`): every K steps each rank snapshots its stage state at the step boundary, keeps
its last two snapshots, and a background thread sends the newest to the next original rank of the world (its
buddy), which keeps it in memory. When a rank is lost, its buddy's copy stands in for it (cli/recover_sources.py).

The copy travels through the world's store (`live.encode`: a JSON header and raw bytes, never pickled), off the
critical path: the snapshot (a CPU copy) is the only work in the step; the sender thread encodes and sets
`<prefix><me>/data` then `<prefix><me>/step`; the buddy's receiver thread polls `step`, reads `data`, keeps it
and acknowledges (`<prefix><me>/ack`). Every store call is bounded by the store's --timeout; a thread that
fails logs it once and stops (the world is failing; the recovery finds the copy it has, or none).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

KEEP = 2  # own snapshots kept: the buddy's copy may lag one snapshot behind the newest
_POLL_S = 0.05
CHUNK_BYTES = 4 << 20  # a copy travels in pieces of at most this: torch's TCPStore refuses values over 8 MiB


class Redundancy:
    """One rank's snapshots, the copy it keeps of its source's (the previous original rank), and the threads."""

    def __init__(self, every: int, me: int) -> None:
        self.every, self.me = every, me
        self.own: dict[int, Any] = {}  # step -> this rank's live.StageState (the last KEEP)
        self.copy: Optional[tuple[int, Any]] = None  # (original rank, its newest live.StageState received)
        self._lock = threading.Lock()
        self._outbox: Any = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._store: Any = None
        self._prefix = ""
        self.buddy: Optional[int] = None
        self.source: Optional[int] = None
        self._reported = False
        self._sent: list[tuple[int, int]] = []  # (step, pieces) of the copies in the store, oldest first

    # ---- a world -------------------------------------------------------------------------------------
    def attach(self, engine: Any, store: Any, generation: int, members: tuple[int, ...]) -> None:
        """Start for the world `members` (original ranks) with this engine: snapshots after every K-th step."""
        self.stop()
        with self._lock:
            self.own.clear()
            self.copy, self._outbox = None, None
        self._sent = []  # a new generation's keys (the prefix names it)
        if len(members) < 2:
            logger.warning("[original rank %d] --redundancy 1: a world of one has no other rank to keep a copy", self.me)
            return
        i = members.index(self.me)
        self.buddy, self.source = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
        self._store, self._prefix = store, f"mp/redundancy/{generation}/"
        self._stop = stop = threading.Event()
        for target, name in ((self._send, "redundancy-send"), (self._receive, "redundancy-receive")):
            threading.Thread(target=target, args=(stop,), name=name, daemon=True).start()
        step_fn = engine.train_step

        def train_step(step: int) -> Any:
            result = step_fn(step)
            if (step + 1) % self.every == 0:
                try:
                    self.snapshot(engine, step)
                except Exception as error:  # noqa: BLE001 - a missing snapshot costs the copy, never the run
                    logger.warning("[original rank %d] --redundancy: the snapshot of step %d failed (%s: %s); a "
                                   "recovery uses an older one or the checkpoint", self.me, step, type(error).__name__, error)
            return result

        engine.train_step = train_step
        try:  # printed with the plan: what the copies will cost (measured again at the first snapshot and copy)
            own, copy = planned_mb(engine, members.index(self.source))
            print(f"[original rank {self.me}] --redundancy 1 memory (plan v{engine.plan.version}): its own snapshots "
                  f"{KEEP} x {own:.2f} MB + a copy of original rank {self.source}'s stage {copy:.2f} MB (parameters and "
                  f"buffers; the optimizer state adds its slots, e.g. x2 with momentum)", flush=True)
        except Exception as error:  # noqa: BLE001 - an estimate only
            logger.warning("[original rank %d] --redundancy: no memory estimate (%s)", self.me, error)

    def stop(self) -> None:
        """End this world's threads (they leave at their next poll or bounded store call)."""
        self._stop.set()

    def holdings(self) -> list[tuple[int, Any]]:
        """What this rank holds for a recovery: (original rank whose, live.StageState) — its own snapshots, the copy."""
        with self._lock:
            out = [(self.me, state) for _, state in sorted(self.own.items())]
            return out + ([self.copy] if self.copy is not None else [])

    # ---- the step boundary -----------------------------------------------------------------------------
    def snapshot(self, engine: Any, step: int) -> None:
        """A CPU copy of the stage state after `step` (on the critical path), handed to the sender thread."""
        from model_parallel.runtime.checkpoint.live import take

        state = take(engine, step, clone=True)
        with self._lock:
            self.own[step] = state
            for old in sorted(self.own)[:-KEEP]:
                del self.own[old]
            self._outbox = state
        self._wake.set()
        if not self._reported:
            self._reported = True
            print(f"[original rank {self.me}] --redundancy 1 (every {self.every} step(s)): its own snapshots "
                  f"{KEEP} x {state.nbytes() / 1e6:.2f} MB, sent to original rank {self.buddy}; it keeps original "
                  f"rank {self.source}'s (size on arrival)", flush=True)

    def flush(self, seconds: float) -> bool:
        """Wait (bounded) until the buddy acknowledged the newest snapshot (the test hook, before a signal)."""
        with self._lock:
            newest = max(self.own) if self.own else None
        if newest is None or self._store is None:
            return True
        deadline = time.monotonic() + seconds
        key = f"{self._prefix}{self.me}/ack"
        while time.monotonic() < deadline:
            try:
                if self._store.check([key]) and int(self._store.get(key).decode()) >= newest:
                    return True
            except Exception:  # noqa: BLE001 - the store gone: nothing to wait for
                return False
            time.sleep(_POLL_S)
        return False

    # ---- threads ---------------------------------------------------------------------------------------
    def _send(self, stop: threading.Event) -> None:
        from model_parallel.runtime.checkpoint.live import encode

        store, prefix = self._store, f"{self._prefix}{self.me}/"
        self._loop(stop, "sending its snapshot", lambda: self._send_one(store, prefix, encode))

    def _send_one(self, store: Any, prefix: str, encode: Callable[[Any], bytes]) -> None:
        self._wake.wait(_POLL_S)
        self._wake.clear()
        with self._lock:
            state, self._outbox = self._outbox, None
        if state is None:
            return
        # In pieces: torch's TCPStore (libuv) resets the connection of a client that sends a value over 8 MiB
        # ("Invalid payload size"), and that connection is this process's only way to its world's store.
        data = encode(state)
        pieces = max(1, -(-len(data) // CHUNK_BYTES))
        for i in range(pieces):
            store.set(f"{prefix}data/{state.step}/{i}", data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
        store.set(f"{prefix}pieces/{state.step}", str(pieces))
        store.set(prefix + "step", str(state.step))  # last: the copy of this step is whole
        self._sent.append((state.step, pieces))
        # A step's pieces go once the buddy acknowledged a newer one (it reads only the newest it was told of).
        acked = int(store.get(prefix + "ack").decode()) if store.check([prefix + "ack"]) else -1
        while len(self._sent) > 1 and self._sent[1][0] <= acked:
            step, count = self._sent.pop(0)
            for i in range(count):
                store.delete_key(f"{prefix}data/{step}/{i}")
            store.delete_key(f"{prefix}pieces/{step}")

    def _receive(self, stop: threading.Event) -> None:
        from model_parallel.runtime.checkpoint.live import decode

        store, prefix, source = self._store, f"{self._prefix}{self.source}/", self.source
        newest = [-1]

        def once() -> None:
            if store.check([prefix + "step"]) and (step := int(store.get(prefix + "step").decode())) > newest[0]:
                pieces = int(store.get(f"{prefix}pieces/{step}").decode())
                data = b"".join(store.get(f"{prefix}data/{step}/{i}") for i in range(pieces))
                state = decode(data, f"the redundancy copy from original rank {source}")
                with self._lock:
                    first, self.copy = self.copy is None, (source, state)
                newest[0] = state.step
                store.set(prefix + "ack", str(state.step))
                if first:
                    print(f"[original rank {self.me}] --redundancy 1: keeps original rank {source}'s stage state, "
                          f"{state.nbytes() / 1e6:.2f} MB (first copy: step {state.step})", flush=True)
            stop.wait(_POLL_S)

        self._loop(stop, "receiving its source's snapshot", once)

    def _loop(self, stop: threading.Event, what: str, once: Callable[[], None]) -> None:
        while not stop.is_set():
            try:
                once()
            except Exception as error:  # noqa: BLE001 - the world is failing: the recovery uses what is held
                if not stop.is_set():
                    logger.warning("[original rank %d] --redundancy: %s stopped: %s", self.me, what,
                                   str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
                return


def planned_mb(engine: Any, other_rank: int) -> tuple[float, float]:
    """MB of parameters and buffers of this rank's stages and of rank `other_rank`'s under the engine's plan (the
    layers of another rank's stage are on meta here: their shapes give the size)."""
    import torch

    from model_parallel.runtime.build.stages import stage_layers

    def size(rank: int) -> float:
        names = {n for k in engine.plan.stages_of_rank(rank) for n in stage_layers(engine.graph, engine.plan, k)}
        layers = [engine.modules[n] for n in names if isinstance(engine.modules.get(n), torch.nn.Module)]
        tensors = [t for layer in layers for t in [*layer.parameters(), *layer.buffers()]]
        return sum(t.numel() * t.element_size() for t in tensors) / 1e6

    return size(engine.rank), size(other_rank)
