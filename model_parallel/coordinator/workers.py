"""The workers' side of the control connection: register, the job request, heartbeats and reports, commands, loss."""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

from model_parallel.coordinator import membership
from model_parallel.coordinator.protocol import ProtocolError, Session
from model_parallel.coordinator.rebalancer import Rebalancer
from model_parallel.coordinator.status import Roster, WorkerState
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, StepReport
from model_parallel.graph.in_flight import SCHEDULE_NAMES

logger = logging.getLogger(__name__)


class WorkerLink:
    """What the coordinator does with a connected worker; mixed into `Coordinator` (server.py), which owns the state.

    The state is the coordinator's, shared by its threads behind `lock` (see server.py).
    """

    # Provided by `Coordinator.__init__` (and its `plan` property).
    lock: threading.RLock
    roster: Roster
    rebalancer: Rebalancer
    done: threading.Event
    shutdown: threading.Event
    job: Optional[Mapping[str, Any]]
    plan: Plan
    checkpoint_dirs: set[str]

    def _register_worker(self, session: Session, message: Mapping[str, Any], where: str) -> WorkerState:
        with self.lock:
            try:
                if message.get("schedule", "1f1b") not in SCHEDULE_NAMES:
                    raise ProtocolError(f"rank {message.get('rank')} runs an unknown schedule {str(message['schedule'])[:40]!r}; "
                                        f"expected one of {sorted(SCHEDULE_NAMES)}")
                if message.get("role") == "worker":  # a re-formed world, or the live plan (membership.py)
                    membership.admit(self.roster, self.rebalancer, message)
                worker, reconnection = self.roster.register(message, session, where, self.plan)
            except ProtocolError as error:  # say why to the worker too: it exits with the cause, not "wrong token?"
                session.send("reply", ok=False, error=str(error))
                raise
            if "schedule" in message:  # the workers' schedule: plans are checked under its rules too
                self.rebalancer.schedule = message["schedule"]
            if message.get("num_microbatches", 0) >= 1:  # m: a plan's stage times are per microbatch
                self.rebalancer.num_microbatches = message["num_microbatches"]
                if message.get("schedule_auto"):  # chosen again at a switch
                    self.rebalancer.schedule_auto = True
            if "schedule_order" in message:  # "fixed": the workers run torch's zero-bubble order, priced so
                self.rebalancer.list_order = message["schedule_order"] != "fixed"
            if "checkpoint_dir" in message and len(self.checkpoint_dirs) < self.roster.world_size:
                self.checkpoint_dirs.add(message["checkpoint_dir"])
            self.done.clear()
            plan = self.plan
        with worker.send_lock:
            session.send("welcome", plan_version=plan.version, plan=plan.to_dict(),
                         issued=max(plan.version, self.rebalancer.highest_issued))
        (logger.warning if reconnection else logger.info)("rank %d %s from %s (pid %d, world size %d)", worker.rank,
                                                          "reconnected" if reconnection else "registered",
                                                          worker.host, worker.pid, worker.world_size)
        return worker

    def _send_job(self, session: Session, message: Mapping[str, Any], where: str) -> bool:
        """Answer a worker that has no model with the job (graph, plan, flags), or say there is none."""
        who = f"rank {message['rank']}" if "rank" in message else where
        job = self.job  # one read: another thread may replace or clear it meanwhile
        if job is None:
            session.send("reply", ok=False, error=self.no_job_reason or "this coordinator serves no job; start the "
                         "worker with --package or --graph/--plan (or give test_socket.py the job)")
            logger.warning("%s asked for the job, but none is served", who)
            return True
        session.send("job", **job)
        logger.info("sent the job (plan v%d) to %s", job["plan_version"], who)
        return True

    def _serve_worker(self, session: Session, worker: WorkerState) -> bool:
        """Read heartbeats/reports until bye (True) or the connection ends (exception / False)."""
        # A short read timeout so a closed coordinator notices promptly; silence is judged by the monitor.
        while not self.shutdown.is_set():
            try:
                message = session.recv(1.0)
            except socket.timeout:
                # A timeout in the middle of a frame leaves the stream unusable; between frames it is fine.
                continue
            with self.lock:  # a message from `worker` arrived just now (its age is measured from here, monotonic)
                back = self.roster.seen(worker, time.monotonic())
            if back:
                logger.warning("rank %d is reachable again", worker.rank)
            kind = message["type"]
            if kind == "heartbeat":
                with self.lock:
                    worker.step = max(worker.step, message["step"])
            elif kind == "report":
                if message["rank"] != worker.rank:
                    raise ProtocolError(f"rank {worker.rank} sent a report for rank {message['rank']}")
                self._on_report(worker, message)
            elif kind == "switch-refused":
                with self.lock:
                    self.rebalancer.refused(worker.rank, message["version"], message["reason"])
            elif kind == "switch-failed":
                with self.lock:
                    self.rebalancer.failed(message["rank"], message["version"], message["reason"])
            elif kind == "bye":
                reason = message["reason"]
                with self.lock:
                    finished = self.roster.bye(worker, reason)
                (logger.info if finished else logger.warning)("rank %d %s: %s", worker.rank, "finished" if finished else
                                                              "is" if worker.status == "recovering" else "ended early", reason)
                self._check_done()
                return True
            else:
                raise ProtocolError(f"rank {worker.rank}: unexpected {kind!r} from a worker")
        return True

    def _on_report(self, worker: WorkerState, message: Mapping[str, Any]) -> None:
        try:
            report = StepReport.from_dict(message)
        except ProtocolError as error:
            with self.lock:
                worker.bad_reports += 1
                first = worker.bad_reports == 1
            # Authenticated but absurd: a bug or a broken clock on that worker, not a reason to drop it.
            (logger.warning if first else logger.debug)(
                "rank %d: rejected a bad report for step %s: %s%s", worker.rank, message["step"], error,
                " (further ones are counted in the status)" if first else "")
            return
        with self.lock:
            self.roster.record(worker, report)
            self.rebalancer.on_report(worker, report, self.roster.workers, self._send_to,
                                      stopping=self.roster.stop_reason is not None)

    def _send_to(self, rank: int, command: Command) -> Optional[WorkerState]:
        """Send `command` to `rank`; returns the registration it went out on (its connection: rebalancer.Send)."""
        worker = self.roster.workers.get(rank)
        if worker is None or worker.session is None or worker.status != "running":
            logger.warning("cannot send %s to rank %d: it is not connected", command.kind, rank)
            return None
        try:
            with worker.send_lock:
                worker.session.send("command", command=command.to_dict())
            return worker
        except OSError as error:
            logger.warning("sending %s to rank %d failed: %s", command.kind, rank, error)
            return None

    def _connection_lost(self, worker: WorkerState) -> None:
        with self.lock:
            if not self.roster.is_current(worker) or self.shutdown.is_set():
                return
        self._mark_unreachable(worker, "its control connection closed without a goodbye")

    def _mark_unreachable(self, worker: WorkerState, why: str) -> None:
        """Note that `worker` cannot be reached; the run goes on (see server.py's module docstring, item 4)."""
        with self.lock:
            if not self.roster.is_current(worker):
                return
            forgotten = not worker.reports  # it never trained: nothing to wait for, nothing to keep
            session = self.roster.forget(worker) if forgotten else self.roster.unreachable(worker, why)
        if session is not None:
            try:
                session.sock.shutdown(socket.SHUT_RDWR)  # a silent connection: its thread ends, the worker reconnects
            except OSError:
                pass
        if forgotten:
            logger.warning("rank %d (pid %d on %s) left before its first report (%s); forgotten", worker.rank,
                           worker.pid, worker.host, why)
            self._check_done()
            return
        logger.warning("rank %d (pid %d on %s) is unreachable: %s; the run goes on (a live worker reconnects, "
                       "a dead one is named by its peers)", worker.rank, worker.pid, worker.host, why)
        self._check_done()

    def _check_done(self) -> None:
        with self.lock:
            if self.roster.done(time.monotonic()):
                self.done.set()
