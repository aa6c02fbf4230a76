"""Clients of the coordinator: `CoordinatorChannel` (the runtime's `ControlChannel` over the protocol) and `CtlClient`.

A worker's channel connects with a timeout, registers (rank, host, pid, world size), then a
background thread sends its step reports and a heartbeat every second; another thread reads
commands. `report()` never blocks on the network (a bounded queue; when it is full the oldest
report is dropped). `poll()` returns the next pending command (rank 0 is the one that polls).

Losing the coordinator is never fatal: the channel logs one clear error naming the address and the
reason, the worker keeps training with its current plan, and the channel reconnects (exponential
backoff from 0.25 s to 5 s with jitter, for up to `reconnect_for` seconds, then it gives up and
the run goes on without rebalancing). Reports made meanwhile wait in the bounded queue. The
coordinator is an optimisation, not needed for correctness; it never stops a run. A dead *worker*
is found by its peers (their timeouts and `runtime.wire.health` name it), not by the coordinator.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

from model_parallel.coordinator.connect import CONNECT_TIMEOUT_S, RECONNECT_FIRST_S, _connect, _hang_up, connect_when_listening
from model_parallel.coordinator.connect import fetch_job  # noqa: F401 - where callers (cli/served_job.py) import it from
from model_parallel.coordinator.protocol import Session, new_nonce
from model_parallel.errors import PlanError, ProtocolError
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, StepReport

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
REPORT_QUEUE = 256
RECONNECT_MAX_S = 5.0  # the longest wait between attempts
RECONNECT_FOR_S = 300.0  # give up after this long (training goes on without rebalancing)


class CoordinatorChannel:
    """`ControlChannel` backed by a coordinator; see the module docstring for failure behaviour."""

    def __init__(self, address: str, token: bytes, rank: int, world_size: int,
                 timeout: float = CONNECT_TIMEOUT_S, heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
                 reconnect_for: float = RECONNECT_FOR_S, schedule: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None, live_plan: Optional[Plan] = None, recover: bool = False,
                 generation: int = 0, membership: Optional[Mapping[str, Any]] = None, schedule_auto: bool = False,
                 num_microbatches: Optional[int] = None, schedule_order: Optional[str] = None,
                 wait_for: float = 0.0, peer_timeout: Optional[float] = None) -> None:
        self.address, self.token = address, token
        self.checkpoint_dir = checkpoint_dir  # told to the coordinator, so its last line after a failure can name it
        self.schedule = schedule  # told to the coordinator, which checks plans under this schedule's rules too
        # m: told to the coordinator, which prices a plan's stage times per microbatch (the workers list-build zero
        # bubble's order from them); --schedule auto too: it chooses the schedule again at each switch
        self.auto_fields: dict[str, Any] = {"num_microbatches": int(num_microbatches)} if num_microbatches else {}
        if schedule_auto and num_microbatches:
            self.auto_fields["schedule_auto"] = True
        if schedule_order is not None:  # zero bubble's order (list-built or fixed): what a re-choice prices
            self.auto_fields["schedule_order"] = schedule_order
        if peer_timeout is not None:  # how long a recovery may keep this rank away (coordinator/status.py)
            self.auto_fields["peer_timeout"] = float(peer_timeout)
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.reconnect_for = reconnect_for
        self._lock = threading.Lock()  # guards `session` changes
        self._send_lock = threading.Lock()
        self._commands: "queue.Queue[Command]" = queue.Queue()
        # (message type, fields): step reports, and the rare switch-refused or switch-failed
        self._reports: "queue.Queue[tuple[str, dict[str, Any]]]" = queue.Queue(maxsize=REPORT_QUEUE)
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._step = -1
        self.lost: Optional[str] = None  # why the connection is down right now (None while connected)
        self.gave_up: Optional[str] = None  # set when reconnecting failed for `reconnect_for` seconds
        self.reconnects = 0
        self.stop_reason: Optional[str] = None
        # The newest plan version this rank runs (from its reports) or has accepted a switch to: a switch
        # to a version at or below it is stale or replayed, and refused.
        self.plan_floor = live_plan.version if live_plan is not None else 0
        # What this worker runs, told at every (re)registration: a coordinator started again on the same address
        # learns the live job from it (docs/coordinator.md, "A lost coordinator"). Rank 0 learns each newer plan
        # from the switch it admits; the others only its version (from their reports).
        self.running_version = self.plan_floor
        self._plans: dict[int, dict[str, Any]] = {live_plan.version: live_plan.to_dict()} if live_plan is not None else {}
        self.issued = 0  # the newest plan version the coordinator said it spent (welcome)
        # --recover: a lost peer is not the end of this process (its bye says "recovering"), and the membership
        # generation this channel registers in (docs/reliability.md, "Recovery under a coordinator")
        self.recover, self.generation, self.membership = recover, int(generation), dict(membership or {})
        self._reforming = False  # see reforming()
        self.instance = new_nonce()  # this process's claim on its rank (never shown): see Roster.register
        self.plan_version, self.plan = self.running_version, self._plans.get(self.running_version)
        self.session: Optional[Session] = None
        try:
            # The first connection must work (a wrong token fails at once); only a refused one is retried, for up to
            # `wait_for` seconds (a coordinator started just before its workers may not listen yet)
            self.session = self._register(timeout, wait_for if self.generation == 0 else 0.0)
            self._connected.set()
        except ProtocolError as error:
            if self.generation == 0:
                raise
            # A re-formed world (--recover) trains on whether or not the coordinator is there (it may have been lost
            # with the worker): register in the background, as after a lost connection.
            self.lost = str(error)
            logger.error("rank %d cannot register with the coordinator at %s in generation %d: %s; training continues "
                         "with the survivors' plan (retrying with backoff for up to %.0f s)", rank, address,
                         self.generation, error, reconnect_for)
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"coordinator-send-{rank}", daemon=True),
            threading.Thread(target=self._read_loop, name=f"coordinator-read-{rank}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        if self.session is not None:
            logger.info("rank %d connected to the coordinator at %s (plan v%d)", rank, address, self.plan_version)

    def _register(self, timeout: float, wait_for: float = 0.0) -> Session:
        """Connect (retrying a refused connection for `wait_for` seconds), register and read the welcome (the live
        plan); ProtocolError says why not."""
        session = connect_when_listening(self.address, self.token, timeout, wait_for, self.rank)
        try:
            with self._send_lock:
                session.send("register", role="worker", rank=int(self.rank), host=socket.gethostname(), pid=os.getpid(),
                             world_size=int(self.world_size), instance=self.instance,
                             **({"schedule": self.schedule} if self.schedule is not None else {}),
                             **({"checkpoint_dir": self.checkpoint_dir} if self.checkpoint_dir else {}),
                             **self.auto_fields,
                             **self._live_fields())
            welcome = session.recv(timeout)
        except (OSError, ProtocolError) as error:
            session.sock.close()
            raise ProtocolError(f"coordinator at {self.address} refused rank {self.rank}: {error} "
                                "(wrong token? the coordinator log says why)") from None
        if welcome["type"] == "reply" and not welcome["ok"]:  # refused, and the coordinator says why
            session.sock.close()
            raise ProtocolError(f"coordinator at {self.address} refused rank {self.rank}: "
                                f"{welcome.get('error', 'no reason given')}")
        if welcome["type"] != "welcome":
            session.sock.close()
            raise ProtocolError(f"coordinator at {self.address}: expected welcome, got {welcome['type']!r}")
        self.plan_version = welcome["plan_version"]
        self.plan = welcome["plan"]
        self.issued = max(self.issued, int(welcome.get("issued", welcome["plan_version"])))
        return session

    def _live_fields(self) -> dict[str, Any]:
        """The live job as this worker knows it, for the register message."""
        fields: dict[str, Any] = {"live_version": int(self.running_version), "step": max(self._step, 0),
                                  "generation": self.generation}
        if self.running_version in self._plans:
            fields["live_plan"] = self._plans[self.running_version]
        if self.membership:
            fields["membership"] = self.membership
        return fields

    # ---- ControlChannel --------------------------------------------------------------------------
    def report(self, report: StepReport) -> None:
        if self.gave_up is not None or self._closed.is_set():
            return
        message = report.to_dict()  # the protocol's `report` is the StepReport itself
        self._step = max(self._step, report.step)
        self.plan_floor = max(self.plan_floor, report.plan_version)
        if report.plan_version != self.running_version and report.plan_version in self._plans:
            self._plans = {v: p for v, p in self._plans.items() if v >= report.plan_version}  # older: history
        self.running_version = report.plan_version
        self._queue("report", message)

    def switch_refused(self, version: int, reason: str) -> None:
        """The runtime refused the switch to plan `version` on every rank (the job goes on): tell the coordinator."""
        if self.gave_up is None and not self._closed.is_set():
            self._queue("switch-refused", {"version": int(version), "reason": str(reason)[:4000]})

    def switch_failed(self, version: int, failures: Mapping[int, str]) -> None:
        """The switch to plan `version` failed on the ranks of `failures` ({rank: one-line cause}) after it started;
        every rank rolled back and the job goes on: tell the coordinator."""
        if failures and self.gave_up is None and not self._closed.is_set():
            reason = "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(failures.items()))
            self._queue("switch-failed", {"version": int(version), "rank": int(min(failures)), "reason": reason[:4000]})

    def _queue(self, kind: str, fields: dict[str, Any]) -> None:
        try:
            self._reports.put_nowait((kind, fields))
        except queue.Full:
            # The coordinator is slow to read (or away): drop the oldest report rather than stall training.
            try:
                self._reports.get_nowait()
            except queue.Empty:
                pass
            self._reports.put_nowait((kind, fields))

    def poll(self, before_step: Optional[int] = None) -> Optional[Command]:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def reforming(self) -> None:
        """--recover: this process leaves its world at this step boundary to re-form it (a worker joins): the bye
        that follows says "recovering", and it registers again in the next generation."""
        self._reforming = True

    def close(self, reason: str = "training finished") -> None:
        if self._closed.is_set():
            return
        if self.recover and self._reforming and not reason.startswith(("failed:", "recovering:")):
            reason = "recovering: " + reason  # an admission (cli/worker_join.py): this world re-forms with a joiner
        if self.recover and reason.startswith("failed:"):
            # --recover: this process re-forms the world and registers again in the next generation (a process
            # that cannot recover exits; the coordinator gives a "recovering" rank up like an unreachable one)
            reason = "recovering:" + reason[len("failed:"):]
        # Let queued reports go out first (bounded wait), then say goodbye.
        deadline = time.monotonic() + 2.0
        while not self._reports.empty() and self.session is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        self._closed.set()
        with self._lock:
            session, self.session = self.session, None
        if session is not None:
            try:
                self._send(session, "bye", rank=self.rank, reason=reason)
            except (OSError, ProtocolError):
                pass
            _hang_up(session)
        for thread in self._threads:
            thread.join(timeout=2.0)

    # ---- threads -----------------------------------------------------------------------------------
    def _send(self, session: Session, kind: str, **fields: Any) -> None:
        with self._send_lock:
            session.send(kind, **fields)

    def _drop(self, session: Session, why: str) -> None:
        """The connection `session` failed: close it; the read loop reconnects."""
        with self._lock:
            if self.session is not session or self._closed.is_set():
                return
            self.session = None
            self._connected.clear()
            self.lost = why
        _hang_up(session)
        logger.error("rank %d lost the coordinator at %s: %s; training continues with the current plan "
                     "(reconnecting with backoff for up to %.0f s)", self.rank, self.address, why, self.reconnect_for)

    def _reconnect(self) -> bool:
        """Register again, with exponential backoff and jitter, for up to `reconnect_for` seconds."""
        started = time.monotonic()
        delay, attempts = RECONNECT_FIRST_S, 0
        while not self._closed.is_set():
            if time.monotonic() - started > self.reconnect_for:
                self.gave_up = f"{self.lost}; not back after {attempts} attempt(s) in {self.reconnect_for:.0f} s"
                logger.error("rank %d gave up on the coordinator at %s: %s; training continues with the current "
                             "plan (no more rebalancing)", self.rank, self.address, self.gave_up)
                return False
            # Jitter: the ranks that lost one coordinator do not all knock at the same instant.
            if self._closed.wait(delay * random.uniform(0.5, 1.0)):
                return False
            delay = min(2 * delay, RECONNECT_MAX_S)
            attempts += 1
            try:
                session = self._register(min(self.timeout, RECONNECT_MAX_S))
            except ProtocolError as error:
                logger.debug("rank %d: reconnecting to %s failed: %s", self.rank, self.address, error)
                continue
            with self._lock:
                if self._closed.is_set():
                    _hang_up(session)
                    return False
                self.session, self.lost = session, None
                self._connected.set()
            self.reconnects += 1
            logger.warning("rank %d reconnected to the coordinator at %s after %.1f s (%d attempt(s); plan v%d there)",
                           self.rank, self.address, time.monotonic() - started, attempts, self.plan_version)
            return True
        return False

    def _send_loop(self) -> None:
        last = 0.0
        message: Optional[tuple[str, dict[str, Any]]] = None
        while not self._closed.is_set() and self.gave_up is None:
            if message is None:
                try:
                    message = self._reports.get(timeout=self.heartbeat_interval / 2)
                except queue.Empty:
                    pass
            session = self.session
            if session is None:  # disconnected: reports wait in the bounded queue (oldest dropped)
                self._connected.wait(self.heartbeat_interval / 2)
                continue
            try:
                if message is not None:
                    self._send(session, message[0], **message[1])
                    message, last = None, time.monotonic()
                if time.monotonic() - last >= self.heartbeat_interval:
                    self._send(session, "heartbeat", rank=self.rank, step=max(self._step, 0))
                    last = time.monotonic()
            except ProtocolError as error:  # raised before sending: the protocol refuses this report
                logger.warning("rank %d: not sending a report the protocol refuses: %s", self.rank, error)
                message = None
            except OSError as error:
                if not self._closed.is_set():
                    self._drop(session, f"send failed ({error})")

    def _read_loop(self) -> None:
        while not self._closed.is_set():
            session = self.session
            if session is None:
                if not self._reconnect():
                    return
                continue
            try:
                message = session.recv(1.0)
            except socket.timeout:
                continue
            except (OSError, ProtocolError) as error:
                if not self._closed.is_set():
                    self._drop(session, f"connection closed ({error})" if str(error) else "connection closed")
                continue
            if message["type"] != "command":
                self._drop(session, f"unexpected {message['type']!r} from the coordinator")
                continue
            try:
                command = Command.from_dict(message["command"])
            except ProtocolError as error:
                logger.error("rank %d: ignoring a malformed command from the coordinator: %s", self.rank, error)
                continue
            if self.admit(command):
                self._commands.put(command)

    def admit(self, command: Command) -> bool:
        """Whether to act on an authenticated command: a switch must move to a newer plan than this rank runs."""
        if command.kind == "switch":
            assert command.plan is not None  # Command refuses a switch without a plan
            if command.plan.version <= self.plan_floor:
                why = (f"this rank runs (or was told to switch to) plan v{self.plan_floor} already; a stale or replayed "
                       f"command ({command.reason or 'no reason given'})")
                logger.error("rank %d: refusing a switch to plan v%d: %s", self.rank, command.plan.version, why)
                self.switch_refused(command.plan.version, why)  # the coordinator waits for an answer to every switch
                return False
            self.plan_floor = command.plan.version
            self._plans[command.plan.version] = command.plan.to_dict()
        if command.kind == "stop":
            self.stop_reason = command.reason
        logger.info("rank %d: coordinator command %s %s", self.rank, command.kind, command.reason)
        return True


class CtlClient:
    """An operator's connection: `request(op, **args)` -> the result dict, or PlanError with the reason."""

    def __init__(self, address: str, token: bytes, timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout = timeout
        self.session = _connect(address, token, timeout)
        self.session.send("register", role="ctl", pid=os.getpid(), host=socket.gethostname())

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        try:
            self.session.send("ctl", op=op, args=args)
            reply = self.session.recv(self.timeout)
        except ConnectionError:
            raise ProtocolError(f"the coordinator at {self.address} closed the connection "
                                "(wrong token? the coordinator log says why)") from None
        except socket.timeout:
            raise ProtocolError(f"no reply from the coordinator at {self.address} within {self.timeout:.0f} s") from None
        except OSError as error:
            raise ProtocolError(f"coordinator at {self.address}: {error}") from None
        if reply["type"] != "reply":
            raise ProtocolError(f"coordinator at {self.address}: expected a reply, got {reply['type']!r}")
        if not reply["ok"]:
            raise PlanError(f"coordinator refused {op}: {reply.get('error', 'no reason given')}")
        return dict(reply.get("result", {}))

    def close(self) -> None:
        try:
            self.session.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "CtlClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
