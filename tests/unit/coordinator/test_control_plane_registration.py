"""Who may hold a rank: the world size comes from the served plan, a rank stays with the process that holds it,
and refusals are logged at a bounded rate in all (issue 33 item 7 and two low items)."""
import logging
import re
import socket

import pytest

from model_parallel.cli.common import run_cli
from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel
from model_parallel.coordinator.protocol import client_handshake
from model_parallel.errors import ProtocolError
from model_parallel.ratelog import RateLimitedLog
from support import wait_for
from support.coordinators import chain_graph, live_coordinator, two_stage_plan

TOKEN = b"registration-token"


@pytest.fixture
def coordinator():
    graph = chain_graph(6)
    with live_coordinator(TOKEN, graph, two_stage_plan(graph, 3), policy="manual", config=pol.PolicyConfig(window=3),
                          heartbeat_timeout=30) as coord:
        yield coord


def test_a_stray_worker_with_the_wrong_world_size_leaves_nothing_behind(coordinator, capsys) -> None:
    def stray(argv):
        CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=3, timeout=5)  # then exits, as a worker does
        return 0

    with pytest.raises(SystemExit) as exited:
        run_cli(stray)
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert ("refused rank 0: rank 0 was started with world size 3, but this coordinator's job runs on 2 rank(s) (plan v0); "
            "start every worker with --world_size 2") in err and "wrong token" not in err, err
    assert coordinator.workers == {}  # nothing remembered from it
    channels = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=2) for r in (0, 1)]
    try:
        assert sorted(coordinator.workers) == [0, 1] and all(w.status == "running" for w in coordinator.workers.values())
    finally:
        for channel in channels:
            channel.close()


def test_a_token_holder_cannot_displace_a_rank_by_claiming_its_pid_and_host(coordinator) -> None:
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2)
    try:
        row = next(w for w in coordinator.handle_ctl("status", {})["workers"] if w["rank"] == 0)
        host, port = coordinator.address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            session = client_handshake(sock, TOKEN, 5)
            session.send("register", role="worker", rank=0, world_size=2, host=row["host"], pid=row["pid"])
            reply = session.recv(5)
        assert reply["type"] == "reply" and not reply["ok"]
        assert "rank 0 is already registered and alive" in reply["error"]
        assert coordinator.workers[0].session is not None and coordinator.workers[0].instance == ch0.instance
        # The process that holds the rank still reconnects (its old connection may look open here).
        old = coordinator.workers[0]
        ch0.session.sock.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: ch0.reconnects == 1, timeout=15, what="the rightful worker reconnecting")
        assert coordinator.workers[0] is not old and coordinator.workers[0].status == "running"
    finally:
        ch0.close()


def test_a_second_process_with_the_same_rank_is_told_why(coordinator) -> None:
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2)
    try:
        with pytest.raises(ProtocolError, match="refused rank 0: rank 0 is already registered and alive"):
            CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2, timeout=5)
    finally:
        ch0.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_refusals_from_many_addresses_are_limited_in_all(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="limits")
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("limits"), interval=10.0, burst=5, clock=clock, global_burst=30)
    for minute in range(6):  # 150 addresses, each refused 20 times per interval, for a minute
        for i in range(20):
            for address in range(150):
                log.log(logging.WARNING, f"from 10.0.{address}.1", f"refused connection {i} from 10.0.{address}.1")
        clock.now += 10.0
        log.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) <= 7 * 31, len(lines)  # per interval (and the first flush): the budget and one summary
    clock.now += 10.0
    log.flush()  # what the last flush held back
    lines = [r.getMessage() for r in caplog.records]
    summaries = [line for line in lines if "source(s) held in the last 10 s (at most 30 lines per 10 s in all)" in line]
    assert len(summaries) == 7 and summaries[0].startswith("720 more line(s) from 150 source(s)"), summaries[0]
    # Nothing is lost: every refusal is a line or in a count.
    counted = sum(int(re.search(r"(\d+) more", line).group(1)) if " more " in line else 1 for line in lines)
    assert counted == 6 * 20 * 150


def test_a_worker_that_left_before_its_first_report_leaves_nothing_behind(coordinator, caplog) -> None:
    host, port = coordinator.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # a stray start of rank 0, gone in a second
        session = client_handshake(sock, TOKEN, 5)
        session.send("register", role="worker", rank=0, world_size=2, host="elsewhere", pid=4242, instance="ab" * 16)
        assert session.recv(5)["type"] == "welcome"
    wait_for(lambda: 0 not in coordinator.workers, what="the stray forgotten")
    assert "rank 0 (pid 4242 on elsewhere) left before its first report" in caplog.text
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2)  # the real rank 0 is welcome
    try:
        assert coordinator.workers[0].instance == ch0.instance and coordinator.workers[0].pid != 4242
    finally:
        ch0.close()
