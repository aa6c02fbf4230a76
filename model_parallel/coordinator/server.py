"""The coordinator's server: accepts workers and ctl clients, hands their messages to the bookkeeping.

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

Reports are checked before the policy sees them (`StepReport.from_dict`): one with absurd values
is rejected and logged (once per rank), and the connection stays up.

Who does what: this module is the transport (sockets, sessions, admission in admission.py, the
monitor loop); workers.py speaks with a registered worker (register, reports, bye, commands, loss);
status.py keeps the ranks' bookkeeping and writes the status file; rebalancer.py runs the pure
policy (policy.py) and carries plan switches; ctl.py answers operators.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from model_parallel.coordinator import policy as policy_mod
from model_parallel.coordinator.admission import HANDSHAKE_DEADLINE_S, MAX_AUTHENTICATED, MAX_UNAUTHENTICATED, Admission, Ticket
from model_parallel.coordinator.ctl import CtlHandler
from model_parallel.coordinator.protocol import S2C, ProtocolError, Session, encode_frame, make_message, new_nonce
from model_parallel.coordinator.rebalancer import Rebalancer
from model_parallel.coordinator.status import Roster, WorkerState, write_status
from model_parallel.coordinator.workers import WorkerLink
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import SCHEDULE_NAMES
from model_parallel.graph.loader import check_graph
from model_parallel.graph.plan import Plan
from model_parallel.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from model_parallel.optimizer.memory import MemoryLimit

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 5.0
HANDSHAKE_TIMEOUT_S = HANDSHAKE_DEADLINE_S  # from accept to an authenticated register (admission.py)
MAX_CONNECTIONS = MAX_AUTHENTICATED + MAX_UNAUTHENTICATED
NOISE_INTERVAL_S = 10.0  # at most one log line per address per this many seconds about unauthenticated clients


class Coordinator(WorkerLink):
    """The coordinator's sockets and threads; `start()` runs them, `wait()` until the workers are done.

    `policy` is "auto" (rebalance on its own) or "manual" (only ctl rebalance/set-plan/scale).
    All shared state (`roster`, `rebalancer`) sits behind `lock`.
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
        job: Optional[Mapping[str, Any]] = None,
        world_size: Optional[int] = None,
        memory: Optional[MemoryLimit] = None,
        no_job_reason: str = "",
    ) -> None:
        if policy not in ("auto", "manual"):
            raise PlanError(f"--policy must be auto or manual, got {policy!r}")
        missing = [n for s in plan.stages for n in s.node_ids if n not in graph]
        if missing:
            raise PlanError(f"the plan names node(s) the graph lacks, e.g. {missing[:3]}; give the graph the plan was made for")
        # The coordinator builds no layers, but a graph asking for code is refused here too, not
        # only on the workers (constructors are checked for form: their classes live in the workers).
        check_graph(graph, build_constructors=False)
        if memory is not None:  # `--memory_per_worker`: the starting plan fits, and so does every plan issued
            from model_parallel.coordinator.solver import memory_solver

            memory.check(graph, plan, "the starting plan")
            solver = solver or memory_solver(memory.memory_per_worker, memory.footprint)
        if solver is None:
            import model_parallel.optimizer.partition  # noqa: F401 - now, not in the middle of the first decision
        self.token = token
        self.job = job  # what a worker started without a model gets (`job` message fields), if any
        self.no_job_reason = no_job_reason  # told to a worker that asks when there is none (e.g. it is too big)
        self.policy = policy
        self.config = config
        self.status_file = Path(status_file) if status_file else None
        self.heartbeat_timeout = heartbeat_timeout
        self.lock = threading.RLock()
        # The job's world: every worker must be started with this --world_size (default: the ranks plan v0 places).
        ranks = [r for stage in plan.with_default_ranks().stages for r in stage.ranks]
        if world_size is not None and world_size <= max(ranks):
            raise PlanError(f"world size {world_size} is too small for plan v{plan.version}, which places rank {max(ranks)}")
        self.roster = Roster(world_size if world_size is not None else max(ranks) + 1)
        # The schedule the workers run, where the job says (their own flag may differ: then they check what this cannot).
        # "auto": each worker resolves it from the job (runtime/step/auto.py) and names the one it chose when it registers.
        schedule = (job or {}).get("train", {}).get("schedule")
        known = schedule if isinstance(schedule, str) and schedule in SCHEDULE_NAMES else None
        self.rebalancer = Rebalancer(policy_mod.with_cost_proxy(graph), plan, config, solver, auto=policy == "auto",
                                     world_size=self.roster.world_size, schedule=known,
                                     memory=memory)
        self.ctl = CtlHandler(self.lock, self.roster, self.rebalancer, self._send_to, self.status)
        self.shutdown = threading.Event()
        self.done = threading.Event()
        self.checkpoint_dirs: set[str] = set()  # where the workers commit checkpoints (for the resume line)
        self._listener: Optional[socket.socket] = None
        self._admission = Admission()
        # Unauthenticated clients cost at most one log line per address per interval (a flood of them
        # would otherwise write hundreds of lines a second).
        self._noise = RateLimitedLog(logger, NOISE_INTERVAL_S)
        self._threads: list[threading.Thread] = []
        # Open connections and their threads: `stop` closes them and waits, so no connection thread
        # outlives the coordinator (one logging after its caller's streams closed prints a traceback).
        self._connections: dict[threading.Thread, socket.socket] = {}

    # What tests, the demo and the command line read.
    @property
    def graph(self) -> Graph:
        return self.rebalancer.graph

    @property
    def plan(self) -> Plan:
        return self.rebalancer.plan

    @property
    def workers(self) -> dict[int, WorkerState]:
        return self.roster.workers

    @property
    def stop_reason(self) -> Optional[str]:
        return self.roster.stop_reason

    @property
    def last_decision(self) -> str:
        return self.rebalancer.last_decision

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
            sessions = [w.session for w in self.roster.workers.values() if w.session is not None]
        for session in sessions:
            try:
                session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=2.0)
        with self.lock:
            connections = dict(self._connections)
        for conn in connections.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in connections:
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
            with self.lock:
                self._connections[thread] = conn
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
            session.bind_client(first)  # from here every frame, both ways, is bound to both nonces
            # The MAC checked out: the peer holds the token, so it takes a reserved authenticated slot.
            if not self._admission.authenticate(ticket):
                if ticket.closed_by_us:
                    raise ConnectionError(ticket.closed_by_us)
                raise ProtocolError(f"the coordinator already serves {self._admission.max_authenticated} authenticated "
                                    "connections; close idle ctl clients")
            if first["type"] == "probe":  # a worker checking its token before it joins the world: nothing else
                session.send("reply", ok=True, result={})
                clean = True
                return
            if first["type"] == "job-request":
                clean = self._send_job(session, first, where)
                return
            if first["type"] != "register":
                raise ProtocolError(f"first message must be register, got {first['type']!r}")
            if first["role"] == "ctl":
                clean = self.ctl.serve(session, where, self.shutdown)
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
            if worker is not None:
                with self.lock:  # a switch sent on this connection and not answered may never have arrived
                    self.rebalancer.connection_ended(worker)
            if worker is not None and not clean:
                self._connection_lost(worker)
            with self.lock:
                self._connections.pop(threading.current_thread(), None)

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

    # ---- the monitor ---------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        last_write = 0.0
        last_tick = time.monotonic()
        while not self.shutdown.wait(0.25):
            with self.lock:
                now = time.monotonic()  # under the lock: no heartbeat can arrive between this and the check
                paused = now - last_tick
                last_tick = now
                if paused > self.heartbeat_timeout / 2:
                    logger.warning("the coordinator was paused for %.1f s; heartbeat ages restart now", paused)
                    self.roster.paused(now)
                silent = self.roster.silent(now, self.heartbeat_timeout)
            for worker, age in silent:
                self._mark_unreachable(worker, f"no heartbeat for {age:.1f} s (limit {self.heartbeat_timeout:g} s)")
            self._check_done()
            if now - last_write >= 1.0 or silent:  # at most once a second (each write fsyncs)
                self._write_status()
                last_write = now

    # ---- ctl and status ----------------------------------------------------------------------------
    def handle_ctl(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Run one ctl operation (ctl.py); returns its JSON result or raises a ModelParallelError."""
        return self.ctl.handle(op, args)

    def speeds(self) -> dict[int, float]:
        """Latest speed estimate per rank (ranks without samples are absent)."""
        with self.lock:
            return self.rebalancer.speeds(self.roster.workers)

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {**self.rebalancer.summary(self.roster.workers), "policy": self.policy,
                    "workers": self.roster.rows(time.monotonic()), "stop_reason": self.roster.stop_reason,
                    "generation": self.roster.generation, "world_size": self.roster.world_size,
                    "recoveries": list(self.roster.recoveries), "learned": self.roster.learned,
                    "checkpoint_dirs": sorted(self.checkpoint_dirs)}

    def _write_status(self, force: bool = False) -> None:
        if self.status_file is None:
            return
        with self.lock:
            if not (self.roster.dirty or force):
                return
            self.roster.dirty = False
            data = self.status()
        write_status(self.status_file, data)
