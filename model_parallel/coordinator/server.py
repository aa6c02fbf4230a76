"""The coordinator: accepts workers and ctl clients, tracks plans and stage times, rebalances.

Threads, not asyncio: one accept loop, one thread per connection (bounded), one monitor thread
(heartbeat ages + status file). All shared state sits behind one lock; sockets are only
written under their connection's send lock.

Life of a run:
  1. workers connect and `register` (rank, host, pid, world size); each gets `welcome` with the
     live plan and its version (v0 from --plan);
  2. every rank sends a `heartbeat` each second and a `report` after every step;
  3. with `--policy auto`, after enough samples the policy (`policy.decide`) may propose plan v+1;
     the coordinator sends `command {switch}` to rank 0, whose runtime broadcasts it to all ranks
     at the next step boundary; reports carrying the new `plan_version` confirm the switch;
  4. a worker silent for more than `heartbeat_timeout` seconds (5 s), or whose connection closes
     without a `bye`, is marked `unreachable` (logged, shown in the status) and nothing else: the
     coordinator never stops a run. Its view can be stale (it may itself have been paused, or only
     the control link failed while the data plane is fine); a live worker reconnects and is
     `running` again, and a dead one is named by its peers, whose timeouts end the run;
  5. when no worker is running any more and one has said `bye` (or all stayed unreachable for
     `UNREACHABLE_GRACE_S`), the coordinator exits.

Reports are checked before the policy sees them (`policy.report_problem`): one with absurd values
is rejected and logged (once per rank), and the connection stays up.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from model_parallel.coordinator import policy as policy_mod
from model_parallel.coordinator.admission import HANDSHAKE_DEADLINE_S, MAX_AUTHENTICATED, MAX_UNAUTHENTICATED, Admission, Ticket
from model_parallel.coordinator.protocol import S2C, ProtocolError, Session, encode_frame, make_message, new_nonce
from model_parallel.errors import ModelParallelError, PlanError
from model_parallel.fileio import atomic_write_json
from model_parallel.graph.core import Graph
from model_parallel.graph.loader import check_graph
from model_parallel.graph.plan import Plan
from model_parallel.ratelog import RateLimitedLog

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 5.0
HANDSHAKE_TIMEOUT_S = HANDSHAKE_DEADLINE_S  # from accept to an authenticated register (admission.py)
CTL_IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = MAX_AUTHENTICATED + MAX_UNAUTHENTICATED
NOISE_INTERVAL_S = 10.0  # at most one log line per address per this many seconds about unauthenticated clients
WARMUP_STEPS = 1  # samples from the first step(s) under a plan include warm-up/migration noise
SAMPLE_HISTORY = 200
UNREACHABLE_GRACE_S = 60.0  # every worker unreachable this long (none said bye): nobody is coming back
PENDING_STEPS = 20  # a switch not confirmed this many steps after it was sent was lost (a dropped connection)


@dataclass
class WorkerState:
    rank: int
    host: str
    pid: int
    world_size: int
    session: Optional[Session] = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    last_seen: float = field(default_factory=time.monotonic)
    step: int = -1
    stage: Optional[int] = None
    plan_version: int = 0
    slowdown: float = 1.0
    status: str = "running"  # running | unreachable (may come back) | finished | stopped (said bye early)
    note: str = ""  # why it is unreachable or stopped
    bad_reports: int = 0  # reports rejected by policy.report_problem
    # (step, plan_version, compute_ms, comm_ms, idle_ms, samples_per_s)
    reports: deque = field(default_factory=lambda: deque(maxlen=SAMPLE_HISTORY))


class Coordinator:
    """The coordinator's state and behaviour; `serve()` runs the sockets.

    `policy` is "auto" (rebalance on its own) or "manual" (only ctl rebalance/set-plan/scale).
    """

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        token: bytes,
        policy: str = "auto",
        config: policy_mod.PolicyConfig = policy_mod.PolicyConfig(),
        status_file: Optional[Path] = None,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
        solver: Optional[policy_mod.Solver] = None,
    ) -> None:
        if policy not in ("auto", "manual"):
            raise PlanError(f"--policy must be auto or manual, got {policy!r}")
        missing = [n for s in plan.stages for n in s.node_ids if n not in graph]
        if missing:
            raise PlanError(f"the plan names node(s) the graph lacks, e.g. {missing[:3]}; give the graph the plan was made for")
        # The coordinator builds no layers, but a graph asking for code is refused here too, not
        # only on the workers (constructors are checked for form: their classes live in the workers).
        check_graph(graph, build_constructors=False)
        self.graph = policy_mod.with_cost_proxy(graph)
        self.plan = plan.with_default_ranks()
        self.token = token
        self.policy = policy
        self.config = config
        self.status_file = Path(status_file) if status_file else None
        self.heartbeat_timeout = heartbeat_timeout
        self.solver = solver
        if solver is None:
            try:  # import the optimizer now, not in the middle of the first decision
                import model_parallel.optimizer.partition  # noqa: F401
            except ImportError:
                pass
        self.lock = threading.RLock()
        self.workers: dict[int, WorkerState] = {}
        self.world_size: Optional[int] = None
        self.pending: Optional[Plan] = None  # sent to rank 0, not yet confirmed by reports
        self.pending_step = 0  # the step after which `pending` was sent
        self.version_start_step = 0  # first step run under self.plan
        self.history: list[dict[str, Any]] = []  # plan switches: version, step, reason
        self.last_decision = "no decision yet"
        self._mismatch_warned = False
        self.decisions: deque = deque(maxlen=100)  # policy outcomes whenever the reason changes
        self.last_eval_step = -1
        self.misses = 0  # switches that did not deliver their predicted gain (policy back-off)
        self.review: Optional[tuple[float, float]] = None  # (measured before, predicted) of the last switch
        self.last_prediction: Optional[tuple[float, float]] = None
        # Speeds seen in the first full window under the live plan (policy change detection);
        # None at v0 (the first window may re-plan: calibration) and "learn" right after a switch.
        self.baseline: Optional[dict[int, float]] = None
        self.learn_baseline = False
        self.change_streak = 0
        self.stop_reason: Optional[str] = None
        self.shutdown = threading.Event()
        self.done = threading.Event()
        self._listener: Optional[socket.socket] = None
        self._admission = Admission()
        # Unauthenticated clients cost at most one log line per address per interval (a flood of them
        # would otherwise write hundreds of lines a second).
        self._noise = RateLimitedLog(logger, NOISE_INTERVAL_S)
        self._threads: list[threading.Thread] = []
        self._status_dirty = True

    # ---- sockets -------------------------------------------------------------------------------
    def bind(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and listen; returns the chosen port (port 0 = any free port)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as error:
            listener.close()
            raise PlanError(f"cannot listen on {host}:{port}: {error.strerror or error}; pick another --port") from None
        listener.listen(MAX_CONNECTIONS)
        listener.settimeout(0.5)
        self._listener = listener
        return int(listener.getsockname()[1])

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and run the accept and monitor loops in background threads; returns the port."""
        bound = self.bind(host, port)
        for target, name in ((self._accept_loop, "coordinator-accept"), (self._monitor_loop, "coordinator-monitor")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info("coordinator listening on %s:%d (policy %s, plan v%d, %d stage(s))", host, bound, self.policy,
                    self.plan.version, self.plan.num_stages)
        return bound

    def stop(self) -> None:
        self.shutdown.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        with self.lock:
            sessions = [w.session for w in self.workers.values() if w.session is not None]
        for session in sessions:
            try:
                session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._write_status(force=True)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every registered worker finished or died (or shutdown); True if they did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.shutdown.is_set():
            if self.done.wait(0.2):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
        return self.done.is_set()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        swept = time.monotonic()
        while not self.shutdown.is_set():
            if time.monotonic() - swept >= 0.25:  # also under a flood, when accept never times out
                swept = time.monotonic()
                for ticket in self._admission.expire():
                    self._log_unauthenticated(ticket, logging.WARNING, f"closed a connection from {ticket.address}",
                                              ticket.closed_by_us)
                self._noise.flush()
            try:
                conn, addr = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            ticket, evicted = self._admission.admit(conn, addr[0])
            for old in evicted:
                self._log_unauthenticated(old, logging.WARNING, f"closed a connection from {old.address}", old.closed_by_us)
            thread = threading.Thread(target=self._serve_connection, args=(conn, addr, ticket), daemon=True,
                                      name=f"coordinator-conn-{addr[0]}:{addr[1]}")
            thread.start()

    def _serve_connection(self, conn: socket.socket, addr: tuple, ticket: Ticket) -> None:
        where = f"{addr[0]}:{addr[1]}"
        worker: Optional[WorkerState] = None
        clean = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = new_nonce()
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.sendall(encode_frame(make_message("hello", 0, nonce=nonce, server="model_parallel.coordinator"), None, S2C, nonce))
            session = Session(conn, self.token, nonce, S2C, timeout=HANDSHAKE_TIMEOUT_S)
            first = session.recv(HANDSHAKE_TIMEOUT_S)
            # The MAC checked out: the peer holds the token, so it takes a reserved authenticated slot.
            if not self._admission.authenticate(ticket):
                if ticket.closed_by_us:
                    raise ConnectionError(ticket.closed_by_us)
                raise ProtocolError(f"the coordinator already serves {self._admission.max_authenticated} authenticated "
                                    "connections; close idle ctl clients")
            if first["type"] != "register":
                raise ProtocolError(f"first message must be register, got {first['type']!r}")
            if first["role"] == "ctl":
                clean = self._serve_ctl(session, where)
                return
            worker = self._register_worker(session, first, where)
            clean = self._serve_worker(session, worker)
        except ProtocolError as error:
            self._log_drop(ticket, logging.WARNING, f"dropped client {where}", str(error))
        except (socket.timeout, TimeoutError):
            self._log_drop(ticket, logging.WARNING, f"dropped client {where}", "no complete message within the timeout")
        except ConnectionError as error:  # a worker's loss is reported below; say it for ctl clients too
            self._log_drop(ticket, logging.INFO, f"client {where} closed the connection", str(error))
        except OSError as error:
            if not self.shutdown.is_set():
                self._log_drop(ticket, logging.WARNING, f"connection {where} failed", str(error))
        finally:
            try:
                conn.close()
            except OSError:
                pass
            self._admission.release(ticket)
            if worker is not None and not clean:
                self._connection_lost(worker)

    def _log_drop(self, ticket: Ticket, level: int, what: str, why: str) -> None:
        """Why a connection ended: said in full for an authenticated peer, rate-limited otherwise."""
        if ticket.closed_by_us:
            return  # the accept loop has logged (rate-limited) why it closed this one
        if ticket.authenticated:
            logger.log(level, "%s: %s", what, why)
        else:
            self._log_unauthenticated(ticket, level, what, why)

    def _log_unauthenticated(self, ticket: Ticket, level: int, what: str, why: str) -> None:
        # One line per address and kind of failure per interval: every kind is still seen at once,
        # repeats are counted (the key leaves out numbers such as ports and byte counts).
        self._noise.log(level, f"unauthenticated clients from {ticket.address} ({re.sub(r'[0-9]+', 'N', why)[:60]})",
                        f"{what}: {why}")

    # ---- workers -------------------------------------------------------------------------------
    def _register_worker(self, session: Session, message: Mapping[str, Any], where: str) -> WorkerState:
        rank, world = message.get("rank"), message.get("world_size")
        if rank is None or world is None:
            raise ProtocolError("worker register needs rank and world_size")
        if world < 1 or not 0 <= rank < world:
            raise ProtocolError(f"worker register: rank {rank} is not in a world of {world}")
        with self.lock:
            if self.world_size is not None and world != self.world_size:
                raise ProtocolError(f"rank {rank} says world size {world}, others said {self.world_size}")
            if self.plan.num_ranks > world:
                raise ProtocolError(f"plan v{self.plan.version} needs {self.plan.num_ranks} ranks, rank {rank} is in a world of {world}")
            old = self.workers.get(rank)
            host, pid = str(message.get("host", where)), int(message.get("pid", 0))
            # The same process reconnecting (its old connection may not look closed from here yet) replaces it.
            if old is not None and old.status == "running" and old.session is not None and (old.host, old.pid) != (host, pid):
                raise ProtocolError(f"rank {rank} is already registered and alive (pid {old.pid} on {old.host})")
            self.world_size = world
            worker = WorkerState(rank=rank, host=host, pid=pid, world_size=world, session=session)
            reconnection = old is not None and old.status in ("running", "unreachable")
            if reconnection:  # keep what was learned about this rank
                worker.step, worker.stage, worker.plan_version = old.step, old.stage, old.plan_version
                worker.slowdown, worker.reports, worker.bad_reports = old.slowdown, old.reports, old.bad_reports
                if old.session is not None:
                    old.session.sock.close()
            self.workers[rank] = worker
            self.done.clear()
            plan = self.plan
            self._status_dirty = True
        with worker.send_lock:
            session.send("welcome", plan_version=plan.version, plan=plan.to_dict())
        (logger.warning if reconnection else logger.info)("rank %d %s from %s (pid %d, world size %d)", rank,
                                                          "reconnected" if reconnection else "registered",
                                                          worker.host, worker.pid, world)
        return worker

    def _serve_worker(self, session: Session, worker: WorkerState) -> bool:
        """Read heartbeats/reports until bye (True) or the connection ends (exception / False)."""
        # A short read timeout so a closed coordinator notices promptly; silence is judged by the monitor.
        while not self.shutdown.is_set():
            try:
                message = session.recv(1.0)
            except socket.timeout:
                # A timeout in the middle of a frame leaves the stream unusable; between frames it is fine.
                continue
            self._seen(worker)
            kind = message["type"]
            if kind == "heartbeat":
                with self.lock:
                    worker.step = max(worker.step, message["step"])
            elif kind == "report":
                if message["rank"] != worker.rank:
                    raise ProtocolError(f"rank {worker.rank} sent a report for rank {message['rank']}")
                self._on_report(worker, message)
            elif kind == "bye":
                reason = message["reason"]
                with self.lock:
                    finished = reason == "training finished"
                    worker.status, worker.note = ("finished", "") if finished else ("stopped", reason)
                    worker.session = None
                    if not finished and self.stop_reason is None:
                        self.stop_reason = f"rank {worker.rank}: {reason}"
                    self._status_dirty = True
                (logger.info if finished else logger.warning)("rank %d %s: %s", worker.rank,
                                                              "finished" if finished else "ended early", reason)
                self._check_done()
                return True
            else:
                raise ProtocolError(f"rank {worker.rank}: unexpected {kind!r} from a worker")
        return True

    def _seen(self, worker: WorkerState) -> None:
        """A message from `worker` arrived just now (its age is measured from here, monotonic)."""
        with self.lock:
            worker.last_seen = time.monotonic()
            if worker.status == "unreachable" and self.workers.get(worker.rank) is worker:
                worker.status, worker.note = "running", ""
                self._status_dirty = True
                logger.warning("rank %d is reachable again", worker.rank)

    def _on_report(self, worker: WorkerState, message: Mapping[str, Any]) -> None:
        problem = policy_mod.report_problem(message)
        if problem is not None:
            with self.lock:
                worker.bad_reports += 1
                first = worker.bad_reports == 1
            # Authenticated but absurd: a bug or a broken clock on that worker, not a reason to drop it.
            (logger.warning if first else logger.debug)(
                "rank %d: rejected a bad report for step %s: %s%s", worker.rank, message["step"], problem,
                " (further ones are counted in the status)" if first else "")
            return
        with self.lock:
            worker.step = max(worker.step, message["step"])
            worker.stage = None if message["stage"] < 0 else message["stage"]
            worker.plan_version = message["plan_version"]
            worker.reports.append((message["step"], message["plan_version"], float(message["compute_ms"]),
                                   float(message["comm_ms"]), float(message["idle_ms"]), float(message["samples_per_s"])))
            self._status_dirty = True
            expected = self.plan.stage_of_rank(worker.rank)
            if message["plan_version"] == self.plan.version and worker.stage != expected and not self._mismatch_warned:
                self._mismatch_warned = True
                logger.error("rank %d runs stage %s but plan v%d puts it on stage %s: start the workers with the "
                             "coordinator's --plan (rebalancing decisions would be wrong)", worker.rank, worker.stage,
                             self.plan.version, expected)
            if self.pending is not None and message["plan_version"] >= self.pending.version:
                self._confirm_switch(message["step"])
            elif self.pending is not None and worker.rank == 0 and message["step"] > self.pending_step + PENDING_STEPS:
                # Rank 0 applies a switch at its next step boundary; this one was lost with a dropped connection.
                logger.warning("plan v%d was never applied (rank 0 is at step %d); dropping it", self.pending.version,
                               message["step"])
                self.pending = None
            if self.policy == "auto" and self.pending is None and self.stop_reason is None:
                step = max(w.step for w in self.workers.values())
                # Evaluate at most once per step; after a solve that found nothing worth it, wait a
                # window (solving can take a while on big graphs; the gates before it are cheap).
                if step > self.last_eval_step:
                    try:
                        decision = self._decide(step, force=False)
                    except Exception:  # noqa: BLE001 - a policy bug must not cut this worker's connection
                        logger.exception("the policy failed at step %d; no rebalancing this time", step)
                        self.last_eval_step = step + self.config.window - 1
                        return
                    solved = decision.plan is None and decision.current_ms > 0
                    self.last_eval_step = step + self.config.window - 1 if solved else step
                    if decision.plan is not None:
                        self._issue_switch(decision.plan, f"auto: {decision.reason}", step)

    def _samples(self) -> dict[int, list[float]]:
        """rank -> compute ms measured under the live plan, past its warm-up steps."""
        first = self.version_start_step + WARMUP_STEPS
        return {
            rank: [r[2] for r in w.reports if r[1] == self.plan.version and r[0] >= first]
            for rank, w in self.workers.items()
        }

    def _decide(self, step: int, force: bool) -> policy_mod.Decision:
        samples = self._samples()
        if self.review is not None and all(len(samples.get(r, ())) >= self.config.window for r in policy_mod.active_ranks(self.plan)):
            self._review_switch(samples)
        ranks = policy_mod.active_ranks(self.plan)
        if self.learn_baseline and not force and all(len(samples.get(r, ())) >= self.config.window for r in ranks):
            window = {r: samples[r][-self.config.window:] for r in ranks}
            self.baseline = dict(policy_mod.estimate_speeds(self.graph, self.plan, window).speeds)
            self.learn_baseline = False
            self.last_decision = f"learned the speeds under plan v{self.plan.version}: " + ", ".join(
                f"rank {r} {v:.2f}" for r, v in sorted(self.baseline.items()))
            self.decisions.append({"step": step, "plan_version": self.plan.version, "reason": self.last_decision})
            return policy_mod.Decision(None, self.last_decision)
        decision = policy_mod.decide(self.graph, self.plan, samples, self.config,
                                     steps_since_switch=step - self.version_start_step, solver=self.solver, force=force,
                                     misses=self.misses, baseline=self.baseline, change_streak=self.change_streak)
        if not force:
            self.change_streak = self.change_streak + 1 if decision.extra.get("changed") else 0
        if decision.plan is None and self.baseline is None and decision.estimate is not None and not force:
            self.baseline = dict(decision.estimate.speeds)  # v0 kept: its first full window is the baseline
        if decision.plan is not None:
            self.last_prediction = (decision.current_ms, decision.predicted_ms)
        if decision.reason != self.last_decision:
            self.decisions.append({"step": step, "plan_version": self.plan.version, "reason": decision.reason})
        self.last_decision = decision.reason
        logger.debug("policy at step %d: %s", step, decision.reason)
        return decision

    def _review_switch(self, samples: Mapping[int, list[float]]) -> None:
        """Compare the live plan's measured bottleneck with what its switch predicted (lock held)."""
        assert self.review is not None
        before, predicted = self.review
        self.review = None
        window = self.config.window
        after = max(sorted(samples[r][-window:])[len(samples[r][-window:]) // 2] for r in policy_mod.active_ranks(self.plan))
        ok = policy_mod.delivered(before, predicted, after)
        self.misses = max(0, self.misses - 1) if ok else self.misses + 1
        entry = next((h for h in self.history if h["version"] == self.plan.version), None)
        if entry is not None:
            entry.update(measured_before_ms=round(before, 3), predicted_ms=round(predicted, 3),
                         measured_after_ms=round(after, 3), delivered=ok)
        log = logger.info if ok else logger.warning
        log("plan v%d: bottleneck %.2f -> %.2f ms (predicted %.2f)%s", self.plan.version, before, after, predicted,
            "" if ok else f"; gain not delivered, backing off (threshold now "
                          f"{self.config.threshold_after(self.misses):.0%}, cooldown {self.config.cooldown_after(self.misses)} steps)")

    def _issue_switch(self, plan: Plan, reason: str, step: int) -> None:
        """Send plan v+1 to rank 0 (lock held)."""
        plan = replace(plan, version=self.plan.version + 1)
        self.pending, self.pending_step = plan, step
        # Only policy decisions carry a prediction to check; ctl set-plan/scale do not.
        self.review = self.last_prediction if reason.startswith(("auto", "ctl rebalance")) else None
        self.last_prediction = None
        self.history.append({"version": plan.version, "requested_at_step": step, "reason": reason})
        logger.warning("requesting plan v%d after step %d: %s\n%s", plan.version, step, reason, plan.table())
        from model_parallel.runtime.control import Command  # the runtime owns the command type

        if not self._send_to(0, Command.switch(plan, reason=reason).to_dict()):
            self.pending = None  # rank 0 is away: nothing will apply it (ask again once it is back)

    def _confirm_switch(self, step: int) -> None:
        assert self.pending is not None
        self.plan = self.pending
        self.pending = None
        self.version_start_step = step
        self.last_eval_step = step
        self.baseline = None
        self.learn_baseline = True
        self.change_streak = 0
        for entry in self.history:
            if entry["version"] == self.plan.version:
                entry["applied_at_step"] = step
        logger.warning("plan v%d is live from step %d", self.plan.version, step)

    def _send_to(self, rank: int, command: dict[str, Any]) -> bool:
        worker = self.workers.get(rank)
        if worker is None or worker.session is None or worker.status != "running":
            logger.warning("cannot send %s to rank %d: it is not connected", command.get("kind"), rank)
            return False
        try:
            with worker.send_lock:
                worker.session.send("command", command=command)
            return True
        except OSError as error:
            logger.warning("sending %s to rank %d failed: %s", command.get("kind"), rank, error)
            return False

    def _connection_lost(self, worker: WorkerState) -> None:
        with self.lock:
            if worker.status != "running" or self.workers.get(worker.rank) is not worker:
                return
            if self.shutdown.is_set():
                return
        self._mark_unreachable(worker, "its control connection closed without a goodbye")

    def _mark_unreachable(self, worker: WorkerState, why: str) -> None:
        """Note that `worker` cannot be reached; the run goes on (see the module docstring, item 4)."""
        with self.lock:
            if worker.status != "running" or self.workers.get(worker.rank) is not worker:
                return
            worker.status, worker.note = "unreachable", why
            session, worker.session = worker.session, None
            self._status_dirty = True
        if session is not None:
            try:
                session.sock.shutdown(socket.SHUT_RDWR)  # a silent connection: its thread ends, the worker reconnects
            except OSError:
                pass
        logger.warning("rank %d (pid %d on %s) is unreachable: %s; the run goes on (a live worker reconnects, "
                       "a dead one is named by its peers)", worker.rank, worker.pid, worker.host, why)
        self._check_done()

    def _check_done(self) -> None:
        with self.lock:
            if not self.workers or any(w.status == "running" for w in self.workers.values()):
                return
            registered_all = self.world_size is not None and len(self.workers) >= self.world_size
            said_bye = any(w.status in ("finished", "stopped") for w in self.workers.values())
            now = time.monotonic()
            # An unreachable worker is only given up on after the grace period (it may be reconnecting).
            gone = all(w.status != "unreachable" or now - w.last_seen > UNREACHABLE_GRACE_S for w in self.workers.values())
            if (registered_all or said_bye) and (said_bye or gone):
                self.done.set()

    def _monitor_loop(self) -> None:
        last_write = 0.0
        last_tick = time.monotonic()
        while not self.shutdown.wait(0.25):
            with self.lock:
                now = time.monotonic()  # under the lock: no heartbeat can arrive between this and the check
                paused = now - last_tick
                last_tick = now
                if paused > self.heartbeat_timeout / 2:
                    # This process stood still (SIGSTOP, swap, a debugger): the silence it sees is its own.
                    logger.warning("the coordinator was paused for %.1f s; heartbeat ages restart now", paused)
                    for worker in self.workers.values():
                        worker.last_seen = max(worker.last_seen, now)
                silent = [(w, now - w.last_seen) for w in self.workers.values()
                          if w.status == "running" and now - w.last_seen > self.heartbeat_timeout]
            for worker, age in silent:
                self._mark_unreachable(worker, f"no heartbeat for {age:.1f} s (limit {self.heartbeat_timeout:g} s)")
            self._check_done()
            if now - last_write >= 1.0 or silent:  # at most once a second (each write fsyncs)
                self._write_status()
                last_write = now

    # ---- ctl -------------------------------------------------------------------------------------
    def _serve_ctl(self, session: Session, where: str) -> bool:
        while not self.shutdown.is_set():
            try:
                message = session.recv(CTL_IDLE_TIMEOUT_S)
            except ConnectionError:
                return True
            if message["type"] != "ctl":
                raise ProtocolError(f"ctl client sent {message['type']!r}; expected ctl")
            logger.info("ctl %s from %s", message["op"], where)
            try:
                result = self.handle_ctl(message["op"], message["args"])
            except ModelParallelError as error:
                session.send("reply", ok=False, error=str(error))
                continue
            except Exception as error:  # noqa: BLE001 - a bad request must not kill the coordinator
                logger.exception("ctl %s from %s failed", message["op"], where)
                session.send("reply", ok=False, error=f"internal error: {type(error).__name__}: {error}")
                continue
            session.send("reply", ok=True, result=result)
        return True

    def handle_ctl(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Run one ctl operation; returns its JSON result or raises a ModelParallelError."""
        from model_parallel.runtime.control import MAX_SLOWDOWN, Command

        with self.lock:
            if op == "status":
                return self.status()
            if self.stop_reason is not None:
                raise PlanError(f"the run is stopping ({self.stop_reason}); no plan changes accepted")
            if self.pending is not None and op in ("rebalance", "set-plan", "scale"):
                raise PlanError(f"plan v{self.pending.version} is still being applied; try again in a few steps")
            step = max((w.step for w in self.workers.values()), default=0)
            if op == "rebalance":
                decision = self._decide(step, force=True)
                if decision.plan is None:
                    return {"switched": False, "reason": decision.reason}
                self._issue_switch(decision.plan, f"ctl rebalance: {decision.reason}", step)
                return {"switched": True, "version": self.pending.version, "reason": decision.reason,
                        "plan": self.pending.to_dict()}
            if op == "set-plan":
                plan = Plan.from_dict(args.get("plan"), "set-plan")
                plan = self._check_plan(plan.with_default_ranks())
                self._issue_switch(plan, "ctl set-plan", step)
                return {"switched": True, "version": self.pending.version, "plan": self.pending.to_dict()}
            if op == "scale":
                plan = self._scaled_plan(args.get("workers"))
                self._issue_switch(plan, f"ctl scale --workers {plan.num_stages}", step)
                return {"switched": True, "version": self.pending.version, "plan": self.pending.to_dict()}
            if op == "slow":
                rank, factor = args.get("rank"), args.get("factor")
                if not isinstance(rank, int) or rank not in self.workers:
                    raise PlanError(f"slow: no worker with rank {rank!r}; running ranks are {sorted(self.workers)}")
                if not isinstance(factor, (int, float)) or not 1.0 <= factor <= MAX_SLOWDOWN:
                    raise PlanError(f"slow --factor must be a number from 1 (back to normal) to {MAX_SLOWDOWN:g}, got {factor!r}")
                command = Command.slowdown(rank, float(factor), reason="ctl slow")
                if not self._send_to(0, command.to_dict()):
                    raise PlanError("slow: rank 0 is not connected, so the slowdown cannot be broadcast")
                self.workers[rank].slowdown = float(factor)
                return {"rank": rank, "factor": float(factor)}
        raise PlanError(f"unknown ctl op {op!r}")

    def _check_plan(self, plan: Plan) -> Plan:
        nodes = [n for s in plan.stages for n in s.node_ids]
        missing = sorted(set(self.graph.by_id) - set(nodes))
        extra = sorted(set(nodes) - set(self.graph.by_id))
        if missing or extra:
            raise PlanError(f"set-plan: the plan must cover the graph's {len(self.graph)} nodes exactly; "
                            f"missing {missing[:3]}, unknown {extra[:3]}")
        alive = {r for r, w in self.workers.items() if w.status == "running"}
        ranks = {r for s in plan.stages for r in s.ranks}
        if not ranks <= alive:
            raise PlanError(f"set-plan: the plan uses rank(s) {sorted(ranks - alive)} which are not running (running: {sorted(alive)})")
        return plan

    def _scaled_plan(self, count: Any) -> Plan:
        alive = sorted(r for r, w in self.workers.items() if w.status == "running")
        if not isinstance(count, int) or not 1 <= count <= len(alive):
            raise PlanError(f"scale --workers {count!r}: must be between 1 and the {len(alive)} running worker(s)")
        speeds = self.speeds()
        # Keep the fastest `count` workers (ties: lower rank), in rank order.
        chosen = sorted(sorted(alive, key=lambda r: (-speeds.get(r, 1.0), r))[:count])
        known = [speeds.get(r, 1.0) for r in chosen]
        return policy_mod.plan_for_workers(self.graph, chosen, known, self.plan.version + 1, self.solver)

    def speeds(self) -> dict[int, float]:
        """Latest speed estimate per rank (ranks without samples are absent)."""
        samples = {r: v[-self.config.window:] for r, v in self._samples().items() if v}
        try:
            return dict(policy_mod.estimate_speeds(self.graph, self.plan, samples).speeds)
        except PlanError:
            return {}

    def status(self) -> dict[str, Any]:
        with self.lock:
            samples = self._samples()
            speeds = self.speeds()
            stages = []
            for stage in self.plan.stages:
                for rank in stage.ranks:
                    values = samples.get(rank, [])[-self.config.window:]
                    stages.append({
                        "stage": stage.stage_id, "rank": rank, "num_nodes": len(stage.node_ids),
                        "profiled_ms": policy_mod.stage_profiled_ms(self.graph, stage) / stage.num_replicas,
                        "measured_ms": (sorted(values)[len(values) // 2] if values else None),
                        "speed": speeds.get(rank),
                    })
            workers = [{
                "rank": w.rank, "host": w.host, "pid": w.pid, "status": w.status, "note": w.note,
                "bad_reports": w.bad_reports, "step": w.step,
                "stage": w.stage, "plan_version": w.plan_version, "slowdown": w.slowdown,
                "last_seen_s_ago": round(time.monotonic() - w.last_seen, 2),
                "samples_per_s": (w.reports[-1][5] if w.reports else None),
            } for w in sorted(self.workers.values(), key=lambda w: w.rank)]
            return {
                "plan_version": self.plan.version,
                "plan": self.plan.to_dict(),
                "table": self.plan.table(),
                "pending_version": self.pending.version if self.pending else None,
                "policy": self.policy,
                "last_decision": self.last_decision,
                "misses": self.misses,
                "effective_threshold": self.config.threshold_after(self.misses),
                "stages": stages,
                "workers": workers,
                "history": list(self.history),
                "decisions": list(self.decisions),
                "stop_reason": self.stop_reason,
            }

    def _write_status(self, force: bool = False) -> None:
        if self.status_file is None:
            return
        with self.lock:
            if not (self._status_dirty or force):
                return
            self._status_dirty = False
            data = self.status()
        try:
            atomic_write_json(self.status_file, data)
        except OSError as error:
            logger.warning("cannot write status file %s: %s", self.status_file, error)
