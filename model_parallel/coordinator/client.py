"""Clients of the coordinator: `CoordinatorChannel` (the runtime's `ControlChannel` over the protocol) and `CtlClient`.

A worker's channel connects with a timeout, registers (rank, host, pid, world size), then a
background thread sends its step reports and a heartbeat every second; another thread reads
commands. `report()` never blocks on the network (a bounded queue; when it is full the oldest
report is dropped). `poll()` returns the next pending command (rank 0 is the one that polls).

Losing the coordinator is not fatal: the channel logs one clear error naming the address and the
reason, and the worker keeps training with its current plan (no more rebalancing). The
coordinator is an optimisation, not needed for correctness; a dead *worker* is what stops a run
(the coordinator then sends `stop` to every survivor, and the runtime's own peer timeouts catch
what the coordinator cannot).
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

from model_parallel.coordinator.protocol import Session, client_handshake, parse_address
from model_parallel.errors import PlanError, ProtocolError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
HEARTBEAT_INTERVAL_S = 1.0
REPORT_QUEUE = 256


def _connect(address: str, token: bytes, timeout: float) -> Session:
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as error:
        raise ProtocolError(f"cannot reach the coordinator at {address}: {error.strerror or error}; "
                            "is test_socket.py running there?") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client_handshake(sock, token, timeout)
    except (OSError, ProtocolError) as error:
        sock.close()
        raise ProtocolError(f"coordinator at {address}: handshake failed: {error}") from None


def metrics_to_report(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime's per-step metrics dict (seconds, `samples`) -> the protocol's report fields (ms)."""
    def number(*names: str) -> float:
        for name in names:
            value = metrics.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return 0.0

    step_s = number("step_s")
    samples = number("samples")
    stage = metrics.get("stage")
    return {
        "rank": int(metrics.get("rank", 0)),
        "step": int(metrics.get("step", 0)),
        "stage": -1 if stage is None else int(stage),
        "plan_version": int(metrics.get("plan_version", 0)),
        "compute_ms": number("compute_s") * 1e3 if "compute_s" in metrics else number("compute_ms"),
        "comm_ms": number("comm_s") * 1e3 if "comm_s" in metrics else number("comm_ms"),
        "idle_ms": number("idle_s") * 1e3 if "idle_s" in metrics else number("idle_ms"),
        "samples_per_s": samples / step_s if step_s > 0 else number("samples_per_s"),
    }


class CoordinatorChannel:
    """`ControlChannel` backed by a coordinator; see the module docstring for failure behaviour."""

    def __init__(self, address: str, token: bytes, rank: int, world_size: int,
                 timeout: float = CONNECT_TIMEOUT_S, heartbeat_interval: float = HEARTBEAT_INTERVAL_S) -> None:
        self.address = address
        self.rank = rank
        self.heartbeat_interval = heartbeat_interval
        self.session = _connect(address, token, timeout)
        self._send_lock = threading.Lock()
        self._commands: "queue.Queue[Any]" = queue.Queue()
        self._reports: "queue.Queue[dict[str, Any]]" = queue.Queue(maxsize=REPORT_QUEUE)
        self._closed = threading.Event()
        self._step = -1
        self.lost: Optional[str] = None
        self.stop_reason: Optional[str] = None
        try:
            self._send("register", role="worker", rank=int(rank), host=socket.gethostname(), pid=os.getpid(),
                       world_size=int(world_size))
            welcome = self.session.recv(timeout)
        except (OSError, ProtocolError) as error:
            self.session.sock.close()
            raise ProtocolError(f"coordinator at {address} refused rank {rank}: {error} "
                                "(wrong token? the coordinator log says why)") from None
        if welcome["type"] != "welcome":
            self.session.sock.close()
            raise ProtocolError(f"coordinator at {address}: expected welcome, got {welcome['type']!r}")
        self.plan_version = welcome["plan_version"]
        self.plan = welcome["plan"]
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"coordinator-send-{rank}", daemon=True),
            threading.Thread(target=self._read_loop, name=f"coordinator-read-{rank}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        logger.info("rank %d connected to the coordinator at %s (plan v%d)", rank, address, self.plan_version)

    # ---- ControlChannel --------------------------------------------------------------------------
    def report(self, metrics: dict[str, Any]) -> None:
        if self.lost is not None or self._closed.is_set():
            return
        message = metrics_to_report(metrics)
        self._step = max(self._step, message["step"])
        try:
            self._reports.put_nowait(message)
        except queue.Full:
            # The coordinator is slow to read: drop the oldest report rather than stall training.
            try:
                self._reports.get_nowait()
            except queue.Empty:
                pass
            self._reports.put_nowait(message)

    def poll(self) -> Optional[Any]:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def close(self, reason: str = "training finished") -> None:
        if self._closed.is_set():
            return
        # Let queued reports go out first (bounded wait), then say goodbye.
        deadline = time.monotonic() + 2.0
        while not self._reports.empty() and self.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self._closed.set()
        if self.lost is None:
            try:
                self._send("bye", rank=self.rank, reason=reason)
            except (OSError, ProtocolError):
                pass
        try:
            self.session.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.session.sock.close()
        for thread in self._threads:
            thread.join(timeout=2.0)

    # ---- threads -----------------------------------------------------------------------------------
    def _send(self, kind: str, **fields: Any) -> None:
        with self._send_lock:
            self.session.send(kind, **fields)

    def _lose(self, why: str) -> None:
        if self.lost is None and not self._closed.is_set():
            self.lost = why
            logger.error("rank %d lost the coordinator at %s: %s; training continues with the current plan "
                         "(no more rebalancing)", self.rank, self.address, why)

    def _send_loop(self) -> None:
        last = 0.0
        while not self._closed.is_set() and self.lost is None:
            try:
                message = self._reports.get(timeout=self.heartbeat_interval / 2)
            except queue.Empty:
                message = None
            try:
                if message is not None:
                    self._send("report", **message)
                    last = time.monotonic()
                if time.monotonic() - last >= self.heartbeat_interval:
                    self._send("heartbeat", rank=self.rank, step=max(self._step, 0))
                    last = time.monotonic()
            except (OSError, ProtocolError) as error:
                if not self._closed.is_set():
                    self._lose(f"send failed ({error})")
                return

    def _read_loop(self) -> None:
        from model_parallel.runtime.control import Command

        while not self._closed.is_set() and self.lost is None:
            try:
                message = self.session.recv(1.0)
            except socket.timeout:
                continue
            except (OSError, ProtocolError) as error:
                if not self._closed.is_set():
                    self._lose(f"connection closed ({error})" if str(error) else "connection closed")
                return
            if message["type"] != "command":
                self._lose(f"unexpected {message['type']!r} from the coordinator")
                return
            try:
                command = Command.from_dict(message["command"])
            except ProtocolError as error:
                logger.error("rank %d: ignoring a malformed command from the coordinator: %s", self.rank, error)
                continue
            if command.kind == "stop":
                self.stop_reason = command.reason
            logger.info("rank %d: coordinator command %s %s", self.rank, command.kind, command.reason)
            self._commands.put(command)


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
