"""The control plane cannot be locked out or flooded: idle and hostile connections get a handshake
deadline and a per-address limit, authenticated workers and ctl keep their own slots, refusals are
logged at a bounded rate with a count, and the token never needs to be on a command line."""
from __future__ import annotations

import logging
import os
import re
import socket
import time

import pytest

from model_parallel.coordinator import admission as adm
from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient
from model_parallel.ratelog import RateLimitedLog
from support.coordinators import live_coordinator

TOKEN = b"limits-token"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- RateLimitedLog -------------------------------------------------------------------------------------
def test_rate_limited_log_writes_one_line_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="limits")
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("limits"), interval=10.0, burst=3, clock=clock)
    written = [log.log(logging.WARNING, "from 10.0.0.7", f"refused connection {i}") for i in range(500)]
    assert written[:4] == [True, True, True, False] and written.count(True) == 3 and len(caplog.records) == 3
    assert log.flush() == 0, "nothing is summarised before the interval is over"
    clock.now += 10.0
    assert log.flush() == 1
    assert caplog.records[-1].getMessage() == "from 10.0.0.7: 497 more like this in the last 10 s; the last: refused connection 499"
    assert log.log(logging.WARNING, "from 10.0.0.7", "again") and caplog.records[-1].getMessage() == "again"


def test_rate_limited_log_counts_held_lines_in_the_next_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="limits")
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("limits"), interval=5.0, burst=1, clock=clock)
    for _ in range(3):
        log.log(logging.INFO, "k", "line")
    log.log(logging.INFO, "other key", "separate")
    clock.now += 6.0
    log.log(logging.INFO, "k", "line")
    assert [r.getMessage() for r in caplog.records] == ["line", "separate", "line (and 2 more like this since the last such line)"]


# ---- Admission ------------------------------------------------------------------------------------------
@pytest.fixture
def sockets():
    made: list[socket.socket] = []

    def make() -> socket.socket:
        a, b = socket.socketpair()
        made.extend((a, b))
        return a

    yield make
    for sock in made:
        sock.close()


def test_admission_displaces_the_oldest_of_an_address_and_keeps_other_addresses(sockets) -> None:
    admission = adm.Admission(max_unauthenticated=6, max_per_address=2, max_authenticated=2)
    other, _ = admission.admit(sockets(), "10.0.0.2")
    first, _ = admission.admit(sockets(), "10.0.0.1")
    second, evicted = admission.admit(sockets(), "10.0.0.1")
    assert evicted == []
    third, evicted = admission.admit(sockets(), "10.0.0.1")
    assert evicted == [first] and "displaced" in first.closed_by_us
    assert first.conn.recv(1) == b"", "the displaced connection is shut down (its thread wakes up)"
    assert admission.counts() == (3, 0) and not other.closed_by_us


def test_admission_global_cap_displaces_the_oldest(sockets) -> None:
    admission = adm.Admission(max_unauthenticated=3, max_per_address=2)
    tickets = [admission.admit(sockets(), f"10.0.0.{i}")[0] for i in range(3)]
    _, evicted = admission.admit(sockets(), "10.0.0.9")
    assert evicted == [tickets[0]] and admission.counts() == (3, 0)


def test_admission_handshake_deadline_and_reserved_authenticated_slots(sockets) -> None:
    clock = Clock()
    admission = adm.Admission(max_unauthenticated=4, max_per_address=4, max_authenticated=1, handshake_deadline=3.0, clock=clock)
    idle, _ = admission.admit(sockets(), "10.0.0.1")
    worker, _ = admission.admit(sockets(), "10.0.0.2")
    assert admission.authenticate(worker) and admission.counts() == (1, 1)
    clock.now += 3.5
    assert admission.expire() == [idle] and "within 3 s" in idle.closed_by_us
    assert not admission.authenticate(idle), "a connection closed for its deadline cannot authenticate afterwards"
    late, _ = admission.admit(sockets(), "10.0.0.3")
    assert not admission.authenticate(late), "the authenticated pool is full"
    admission.release(worker)
    admission.release(worker)  # idempotent
    assert admission.counts() == (0, 0)


# ---- a live coordinator under a flood of idle connections --------------------------------------------------
@pytest.fixture
def coordinator():
    with live_coordinator(TOKEN, policy="manual", config=pol.PolicyConfig(window=3), heartbeat_timeout=30) as coord:
        yield coord


def test_idle_connections_cannot_lock_out_ctl_or_a_worker(coordinator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="model_parallel.coordinator.server")
    host, port = coordinator.address.split(":")
    idle = []
    try:
        for _ in range(100):  # more than the old limit of 64; none sends a byte
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        with CtlClient(coordinator.address, TOKEN, timeout=5) as ctl:  # its timeout fails a blocked request
            status = ctl.request("status")
        assert status["plan_version"] == 0
        channel = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2, timeout=5)
        try:
            assert channel.plan_version == 0 and coordinator.workers[0].status == "running"
        finally:
            channel.close()
        # 100 idle connections were closed (displaced or past the deadline) in a bounded number of lines.
        unauthenticated, _ = coordinator._admission.counts()
        assert unauthenticated <= adm.MAX_PER_ADDRESS
        lines = [r.getMessage() for r in caplog.records if "127.0.0.1" in r.getMessage() and "closed a connection" in r.getMessage()]
        assert 1 <= len(lines) <= coordinator._noise.burst + 2, lines
        assert "displaced by a newer connection" in lines[0]
    finally:
        for sock in idle:
            sock.close()


def test_flood_summary_line_carries_the_count(coordinator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="model_parallel.coordinator.server")
    coordinator._noise.interval = 1.0  # summarise after 1 s instead of 10 s
    host, port = coordinator.address.split(":")
    flood = adm.MAX_PER_ADDRESS + 40
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(flood)]

    def held_back() -> int:
        # "...: N more like this in the last 1 s; ..." or "... (and N more like this since the last such line)"
        lines = [r.getMessage() for r in caplog.records if "displaced" in r.getMessage()]
        return sum(int(re.search(r"(\d+) more like this", line).group(1)) for line in lines if "more like this" in line)

    try:
        displaced = flood - adm.MAX_PER_ADDRESS  # each connection past the limit displaces the oldest waiting one
        deadline = time.monotonic() + 10
        expected = displaced - coordinator._noise.burst  # the first few are logged in full, the rest counted
        while time.monotonic() < deadline and held_back() < expected:
            time.sleep(0.05)
        assert held_back() == expected, [r.getMessage() for r in caplog.records]
        assert len(caplog.records) < 2 * coordinator._noise.burst + 4
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.slow
def test_trickling_client_is_closed_at_the_handshake_deadline(coordinator) -> None:
    host, port = coordinator.address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.recv(4096)  # the hello
        sock.sendall(b"\x00")  # a frame starts ... and never finishes
        sock.settimeout(adm.HANDSHAKE_DEADLINE_S + 5)  # a socket.timeout here: the trickle was never closed
        while True:
            try:
                if not sock.recv(4096):
                    break
            except ConnectionResetError:
                break


def test_worker_takes_the_token_from_the_environment(coordinator) -> None:
    from model_parallel.cli.worker import build_parser, make_channel

    os.environ["MODEL_PARALLEL_TOKEN"] = TOKEN.decode()
    try:
        channel = make_channel(build_parser().parse_args(["--coordinator", coordinator.address]), 0, 2)
    finally:
        del os.environ["MODEL_PARALLEL_TOKEN"]
    try:
        assert channel.plan_version == 0 and coordinator.workers[0].status == "running"
    finally:
        channel.close()
