"""Recorded coordinator frames replayed by a proxy without the token: nothing is applied (issue 33, item 4)."""
import socket
import threading

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient, fetch_job
from model_parallel.errors import ProtocolError
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import Command, StepReport
from support import wait_for
from support.coordinators import chain_graph, live_coordinator, two_stage_plan

TOKEN = b"replay-token"


def report(rank, step, version=0):
    return StepReport(rank=rank, step=step, plan_version=version, stage=rank, step_ms=20.0, compute_ms=4.0, comm_ms=1.0,
                      idle_ms=0.0, samples_per_s=400.0)


class RecordingProxy:
    """A localhost TCP proxy holding no token: relays and records server->client bytes, then replays them.

    `mode = "record"`: each client connection is relayed to the coordinator, its server->client bytes kept.
    `mode = "replay"`: a new client gets recording `replay_index` (hello, welcome or job, commands) as sent
    then; `replayed` counts the clients that hung up on it."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream, self.mode, self.replay_index = upstream, "record", 0
        self.recorded: list[bytearray] = []
        self.replayed = 0
        self._live: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(10)
            with self._lock:
                self._live.append(client)
            if self.mode == "replay":
                self._spawn(self._replay, client)
                continue
            server = socket.create_connection(self.upstream, timeout=10)
            record = bytearray()
            with self._lock:
                self._live.append(server)
                self.recorded.append(record)
            self._spawn(self._pump, client, server, None)
            self._spawn(self._pump, server, client, record)

    def _pump(self, src: socket.socket, dst: socket.socket, record) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if record is not None:
                    record.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            _shut(sock)

    def _replay(self, client: socket.socket) -> None:
        try:
            client.sendall(bytes(self.recorded[self.replay_index]))
            while client.recv(65536):  # whatever the client says goes nowhere; wait for it to hang up
                pass
        except OSError:
            pass
        _shut(client)
        with self._lock:
            self.replayed += 1

    def cut(self) -> None:
        """Close every relayed connection (clients reconnect, and meet the replay)."""
        with self._lock:
            live, self._live = self._live, []
        for sock in live:
            _shut(sock)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self.cut()
        for thread in self._threads:
            thread.join(timeout=5)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@pytest.fixture
def coordinator():
    graph = chain_graph(6)
    plan = two_stage_plan(graph, 3)
    job = {"graph": {"nodes": []}, "plan": plan.to_dict(), "plan_version": 0, "train": {"lr": 0.5}}
    with live_coordinator(TOKEN, graph, plan, policy="manual", config=pol.PolicyConfig(window=3), heartbeat_timeout=30,
                          job=job) as coord:
        proxy = RecordingProxy(("127.0.0.1", int(coord.address.rsplit(":", 1)[1])))
        try:
            yield coord, proxy
        finally:
            proxy.close()


def test_replayed_switch_slowdown_and_welcome_are_refused_by_a_worker(coordinator) -> None:
    coord, proxy = coordinator
    ch0 = CoordinatorChannel(proxy.address, TOKEN, rank=0, world_size=2, reconnect_for=60)  # through the proxy
    ch1 = CoordinatorChannel(coord.address, TOKEN, rank=1, world_size=2)
    try:
        for step in range(3):
            ch0.report(report(0, step))
            ch1.report(report(1, step))
        wait_for(lambda: all(w.step == 2 for w in coord.workers.values()), what="reports")
        with CtlClient(coord.address, TOKEN) as ctl:
            ctl.request("slow", rank=1, factor=100.0)
            assert wait_for(ch0.poll, what="slowdown").kind == "slowdown"
            ctl.request("scale", workers=1)  # the job onto one worker: the switch the attack replays
            switch = wait_for(ch0.poll, what="switch")
        assert switch.kind == "switch" and switch.plan.num_stages == 1 and switch.plan.version == 1
        # The proxy now replays what it recorded (hello, welcome, slowdown, switch) to the worker's next connection.
        proxy.mode = "replay"
        proxy.cut()
        wait_for(lambda: proxy.replayed >= 2, timeout=20, what="two replayed connections")
        assert ch0.poll() is None, "a replayed command was applied"
        assert ch0.reconnects == 0 and ch0.session is None
        with pytest.raises(ProtocolError, match="authentication failed"):
            CoordinatorChannel(proxy.address, TOKEN, rank=0, world_size=2, timeout=5)
    finally:
        ch0.close()
        ch1.close()


def test_replayed_job_reply_is_refused(coordinator) -> None:
    coord, proxy = coordinator
    job, _ = fetch_job(proxy.address, lambda: TOKEN, rank=1, timeout=10)  # recorded through the proxy
    assert job["type"] == "job" and job["train"] == {"lr": 0.5}
    proxy.mode = "replay"
    with pytest.raises(ProtocolError, match="could not get the job.*authentication failed"):
        fetch_job(proxy.address, lambda: TOKEN, rank=1, timeout=2)
    assert proxy.replayed >= 1


def test_a_worker_refuses_a_switch_to_the_plan_version_it_runs(coordinator, caplog) -> None:
    coord, _ = coordinator
    ch0 = CoordinatorChannel(coord.address, TOKEN, rank=0, world_size=2)
    try:
        ch0.report(report(0, 5, version=3))  # this rank runs plan v3
        stale = Command.switch(Plan((StagePlan(0, tuple(coord.graph.topological_order), ranks=(0,)),), version=3))
        assert not ch0.admit(stale)
        assert "refusing a switch to plan v3: this rank runs (or was told to switch to) plan v3" in caplog.text
        newer = Command.switch(Plan((StagePlan(0, tuple(coord.graph.topological_order), ranks=(0,)),), version=4))
        assert ch0.admit(newer) and not ch0.admit(newer)  # the same switch twice: the second is a replay
        # A coordinator that (re)started below the workers' version numbers its next plan above theirs.
        wait_for(lambda: coord.workers.get(0) is not None and coord.workers[0].step == 5, what="the v3 report")
        assert coord.handle_ctl("scale", {"workers": 1})["version"] == 4
    finally:
        ch0.close()
