"""The coordinator's bookkeeping of ranks (`Roster`, one `WorkerState` per rank) and its status file.

A rank's status: `running` (connected, heard from within the heartbeat timeout), `unreachable` (may
come back: its view can be stale, see server.py), `recovering` (`--recover`: it lost a peer and re-forms
the world; it registers again in the next membership generation, or is given up on like an unreachable
one), `finished` (said bye after the last step) or `stopped` (said bye early; the run is stopping). The roster only records; the server decides when
to look (heartbeats, the monitor loop). Every `Roster` method runs with the coordinator's lock held.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from model_parallel.coordinator.protocol import ProtocolError, Session
from model_parallel.fileio import atomic_write_json
from model_parallel.graph.plan import Plan, measured_calibration
from model_parallel.messages import StepReport

logger = logging.getLogger(__name__)

SAMPLE_HISTORY = 200
RECOVERY_LOG = 100  # re-formed worlds kept in the status (ctl status prints the latest few)
UNREACHABLE_GRACE_S = 60.0  # every worker unreachable this long (none said bye): nobody is coming back
# A rank recovering (--recover) is back within its membership wait (runtime/wire/recovery.JOIN_TIMEOUTS = 3 of its
# --timeout) and a restore: given up on after this many of its --timeout, when that is longer than the grace above.
RECOVERY_TIMEOUTS = 4.0


def _bounded_timeout(value: Any) -> float:
    """A worker's --timeout as a grace: a number in 0..1 day (a NaN or infinite one would keep a coordinator forever)."""
    seconds = float(value)
    return min(seconds, 86400.0) if math.isfinite(seconds) and seconds > 0 else 0.0


@dataclass
class WorkerState:
    rank: int
    host: str
    pid: int
    world_size: int
    session: Optional[Session] = None
    instance: str = ""  # the worker process's secret registration id: only it may replace this rank while it runs
    peer_timeout: float = 0.0  # the worker's --timeout, as it registered (0: not said)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    last_seen: float = field(default_factory=time.monotonic)
    step: int = -1
    stage: Optional[int] = None
    plan_version: int = 0
    slowdown: float = 1.0
    status: str = "running"  # running | unreachable (may come back) | finished | stopped (said bye early)
    note: str = ""  # why it is unreachable or stopped
    bad_reports: int = 0  # reports refused by StepReport.from_dict
    reports: deque[StepReport] = field(default_factory=lambda: deque(maxlen=SAMPLE_HISTORY))


class Roster:
    """Who registered, what each rank last said, and whether the run is over (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        self.workers: dict[int, WorkerState] = {}
        # From the served plan, never from a registration: a worker started once with a wrong --world_size
        # is refused and leaves nothing behind that could turn away the right ones.
        self.world_size = world_size
        self.stop_reason: Optional[str] = None  # a rank ended early: no more plan changes
        self.dirty = True  # something the status file shows changed since it was last written
        self.generation = 0  # the membership generation served (--recover: each re-formed world is the next)
        self.recoveries: list[dict[str, Any]] = []  # the last RECOVERY_LOG re-formed worlds: who was lost, the world, plan
        self.learned: Optional[dict[str, Any]] = None  # the live plan learned from the workers (a restarted coordinator)

    def new_generation(self, generation: int, world_size: int, recovery: dict[str, Any]) -> None:
        """The survivors re-formed the world (membership.py): the old registrations and the lost ranks' state go."""
        self.workers.clear()
        self.generation, self.world_size, self.stop_reason = generation, world_size, None
        self.recoveries.append(recovery)
        del self.recoveries[:-RECOVERY_LOG]  # an elastic job admits and loses workers all week (`generation` counts all)
        self.dirty = True

    def register(self, message: Mapping[str, Any], session: Session, where: str, plan: Plan) -> tuple[WorkerState, bool]:
        """Admit a worker's `register` (ProtocolError says why not); returns it and whether it is a reconnection."""
        rank, world = message.get("rank"), message.get("world_size")
        if rank is None or world is None:
            raise ProtocolError("worker register needs rank and world_size")
        if world != self.world_size:
            raise ProtocolError(f"rank {rank} was started with world size {world}, but this coordinator's job runs on "
                                f"{self.world_size} rank(s) (plan v{plan.version}); start every worker with "
                                f"--world_size {self.world_size}")
        if not 0 <= rank < world:
            raise ProtocolError(f"rank {rank} is not in the job's world of {world} rank(s) (0..{world - 1})")
        old = self.workers.get(rank)
        host, pid = str(message.get("host", where)), int(message.get("pid", 0))
        instance = str(message.get("instance", ""))
        # A rank belongs to the process that registered it first (reconnecting: its old connection may not
        # look closed from here yet). Its instance id is a secret of that process: the pid and host that
        # `ctl status` shows are not enough to displace it. (A worker that left before its first report was
        # forgotten, `forget`: it holds nothing.)
        if old is not None and old.status in ("running", "unreachable") and not (old.instance and old.instance == instance):
            if old.status == "running" and old.session is not None:
                raise ProtocolError(f"rank {rank} is already registered and alive (pid {old.pid} on {old.host}); "
                                    "a second worker cannot take its place while it runs")
            if old.instance:
                raise ProtocolError(f"rank {rank} belongs to pid {old.pid} on {old.host}, which trained as rank {rank} and is "
                                    "unreachable now; only that process may register it again (to replace a worker, "
                                    "resume the job from its checkpoint with a fresh coordinator)")
        worker = WorkerState(rank=rank, host=host, pid=pid, world_size=world, session=session, instance=instance,
                             peer_timeout=_bounded_timeout(message.get("peer_timeout", 0.0)))
        reconnection = old is not None and old.status in ("running", "unreachable")
        if reconnection:  # keep what was learned about this rank
            worker.step, worker.stage, worker.plan_version = old.step, old.stage, old.plan_version
            worker.slowdown, worker.reports, worker.bad_reports = old.slowdown, old.reports, old.bad_reports
            if old.session is not None:
                old.session.sock.close()
        self.workers[rank] = worker
        self.dirty = True
        return worker, reconnection

    def forget(self, worker: WorkerState) -> Optional[Session]:
        """Drop a current worker that never reported a step (a stray start, a worker that failed before
        training): it leaves nothing behind. Returns its session, for the caller to shut down."""
        del self.workers[worker.rank]
        session, worker.session = worker.session, None
        self.dirty = True
        return session

    def seen(self, worker: WorkerState, now: float) -> bool:
        """A message from `worker` arrived at `now` (monotonic); True when it was unreachable until now."""
        worker.last_seen = now
        if worker.status == "unreachable" and self.workers.get(worker.rank) is worker:
            worker.status, worker.note = "running", ""
            self.dirty = True
            return True
        return False

    def record(self, worker: WorkerState, report: StepReport) -> None:
        worker.step = max(worker.step, report.step)
        worker.stage, worker.plan_version = report.stage, report.plan_version
        worker.reports.append(report)
        self.dirty = True

    def bye(self, worker: WorkerState, reason: str) -> bool:
        """The worker said goodbye; True when it finished training ("training finished"), False when it ended early."""
        finished = reason == "training finished"
        worker.status, worker.note = ("finished", "") if finished else ("stopped", reason)
        worker.session = None
        if reason.startswith("recovering:"):  # --recover: back in the next generation (or given up on after a grace)
            worker.status = "recovering"
            self.dirty = True
            return False
        if not finished and self.stop_reason is None:
            self.stop_reason = f"rank {worker.rank}: {reason}"
        self.dirty = True
        return finished

    def is_current(self, worker: WorkerState) -> bool:
        """`worker` is running and still this rank's latest registration."""
        return worker.status == "running" and self.workers.get(worker.rank) is worker

    def unreachable(self, worker: WorkerState, why: str) -> Optional[Session]:
        """Mark a current running worker unreachable; returns its session, for the caller to shut down."""
        worker.status, worker.note = "unreachable", why
        session, worker.session = worker.session, None
        self.dirty = True
        return session

    def paused(self, now: float) -> None:
        """This process stood still (SIGSTOP, swap, a debugger): the silence it saw is its own."""
        for worker in self.workers.values():
            worker.last_seen = max(worker.last_seen, now)

    def silent(self, now: float, timeout: float) -> list[tuple[WorkerState, float]]:
        """Running workers not heard from for more than `timeout` seconds, with their silence."""
        return [(w, now - w.last_seen) for w in self.workers.values() if w.status == "running" and now - w.last_seen > timeout]

    def done(self, now: float) -> bool:
        """No worker runs any more, and one said bye (or all stayed unreachable for UNREACHABLE_GRACE_S)."""
        if not self.workers or any(w.status == "running" for w in self.workers.values()):
            return False
        registered_all = len(self.workers) >= self.world_size
        said_bye = any(w.status in ("finished", "stopped") for w in self.workers.values())
        # An unreachable worker is only given up on after the grace period (it may be reconnecting).
        gone = all(w.status not in ("unreachable", "recovering") or now - w.last_seen > self.grace(w)
                   for w in self.workers.values())
        over = (registered_all or said_bye) and (said_bye or gone)
        if over and self.stop_reason is None:
            self.stop_reason = self._never_finished()
        return over

    @staticmethod
    def grace(worker: WorkerState) -> float:
        """How long `worker`, unreachable or recovering, may stay away before it is given up on."""
        if worker.status == "recovering":
            return max(UNREACHABLE_GRACE_S, RECOVERY_TIMEOUTS * worker.peer_timeout)
        return UNREACHABLE_GRACE_S

    def _never_finished(self) -> Optional[str]:
        """Why a run whose workers all left did not finish (None: it did). Workers that cannot recover (no checkpoint,
        too few survivors) said "recovering" and then exited 3 without another word, and killed ones say nothing:
        without this the coordinator exited 0, as if every step had run."""
        given_up = sorted((w for w in self.workers.values() if w.status in ("unreachable", "recovering")),
                          key=lambda w: w.rank)
        finished = any(w.status == "finished" for w in self.workers.values())
        recovering = [w for w in given_up if w.status == "recovering"]
        if finished and not recovering:
            return None  # every step ran; a control connection that never came back is not the job's failure
        first = (recovering or given_up or [None])[0]
        if first is None:
            return None
        names = ", ".join(f"{w.rank} ({w.status})" for w in given_up)
        return (f"rank {first.rank}: {(first.note or first.status)[:300]}; rank(s) {names} never came back within "
                f"{max(self.grace(w) for w in given_up):.0f} s and {'not every' if finished else 'no'} worker finished training "
                "(each worker's last lines say why it ended)")

    def step(self) -> int:
        """The furthest step any rank reached (0 before the first)."""
        return max((w.step for w in self.workers.values()), default=0)

    def running(self) -> set[int]:
        return {r for r, w in self.workers.items() if w.status == "running"}

    def rows(self, now: float) -> list[dict[str, Any]]:
        """One status row per rank, by rank."""
        return [{
            "rank": w.rank, "host": w.host, "pid": w.pid, "status": w.status, "note": w.note,
            "bad_reports": w.bad_reports, "step": w.step,
            "stage": w.stage, "plan_version": w.plan_version, "slowdown": w.slowdown,
            "last_seen_s_ago": round(now - w.last_seen, 2),
            "samples_per_s": (w.reports[-1].samples_per_s if w.reports else None),
            "loss": (w.reports[-1].loss if w.reports else None),
        } for w in sorted(self.workers.values(), key=lambda w: w.rank)]


def plan_times_label(extra: Any) -> str:
    """What the times in a plan's table are: the profile's ms, or this machine's (a plan the policy solved on the
    calibrated profile records `time_scale` and `calibration` in its `extra`)."""
    calibration = measured_calibration(extra)
    if calibration is not None:
        return (f"plan table times are THIS MACHINE's ms (the profile's ms x {calibration:.3g}, calibrated on "
                "measured compute when the policy solved it)")
    return "plan table times are the PROFILE's ms (the optimizer's prediction on the profiling machine's clock), not this run's"


def write_status(path: Path, data: Mapping[str, Any]) -> None:
    """Write the status file atomically; a failure is logged, never raised (the run does not need the file)."""
    try:
        atomic_write_json(path, data)
    except OSError as error:
        logger.warning("cannot write status file %s: %s", path, error)
