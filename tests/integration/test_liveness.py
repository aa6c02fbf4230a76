"""Liveness (issue 22, items 2 and 6): the control plane never stops a healthy job; a stalled or dead
rank is named within 1.5 x --timeout by every other process; exit codes say whether every requested
step ran; bad reports are rejected; memory stays flat.

Exit codes of a worker (docs/reliability.md): 0 every requested step ran, 2 usage/configuration,
3 a peer died, stalled or became unreachable, 4 stopped before the requested steps.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import REPO

from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.messages import StepReport
from model_parallel.runtime.launch import LocalWorld, worker_commands
from support import wait_for
from support.mlp import mlp_job
from support.recovery_jobs import release

TOKEN = "liveness-test-token"
TIMEOUT = 6  # --timeout of every worker here
BOUND = 1.5 * TIMEOUT  # every process ends this long after a rank stalls or dies
EXIT_PEER, EXIT_STOPPED = 3, 4
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def args(plan: Path, steps: int, *extra: object) -> list[str]:
    return ["--model", "mlp", "--plan", str(plan), "--steps", str(steps), "--batch_size", "8", "--num_microbatches", "4",
            "--lr", "0.01", "--timeout", str(TIMEOUT), *map(str, extra)]


def error_line(output: str) -> str:
    """The worker's one `[rank r] error: ...` line (exactly one)."""
    lines = [line for line in output.splitlines() if re.match(r"\[rank \d+\] error: ", line)]
    assert len(lines) == 1, f"expected one error line, got {lines}:\n{output[-3000:]}"
    return lines[0]


def exit_times(world: LocalWorld, ranks: list[int], since: float, timeout: float) -> dict[int, float]:
    """Seconds from `since` until each of `ranks` exited (polled every 20 ms; missing: still running)."""
    times: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(times) < len(ranks) and time.monotonic() < deadline:
        for rank in ranks:
            if rank not in times and world.procs[rank].poll() is not None:
                times[rank] = time.monotonic() - since
        time.sleep(0.02)
    return times




def metrics(rank: int, step: int, version: int, compute_s: float) -> StepReport:
    return StepReport(rank=rank, step=step, plan_version=version, stage=rank, step_ms=20.0, compute_ms=compute_s * 1e3,
                      comm_ms=1.0, idle_ms=0.0, samples_per_s=400.0)


def chain_plan():  # noqa: ANN201
    """A graph of 8 equal layers and its 2-stage plan (rank 0, rank 1), for an in-process coordinator."""
    from model_parallel.graph.core import Graph, Node
    from model_parallel.graph.plan import Plan, StagePlan

    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=0.5, backward_ms=0.5) for i in range(8)]
    graph = Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))
    ids = list(graph.topological_order)
    return graph, Plan((StagePlan(0, tuple(ids[:5]), ranks=(0,)), StagePlan(1, tuple(ids[5:]), ranks=(1,))))


# ---- the control plane never stops a healthy job ---------------------------------------------------------
class CuttingProxy:
    """A TCP relay to the coordinator for one worker; `cut()` resets its connections (the worker process lives
    on) and keeps accepting, so the worker can reconnect through it."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                continue
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(None)
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.closed.set()
        self.cut()
        self.listener.close()


def test_control_plane_faults_never_stop_training(tmp_path: Path) -> None:
    """Cut a worker's control connection (it reconnects), then SIGSTOP the coordinator for 8 s and continue
    it (longer than its 5 s heartbeat timeout): the job runs every requested step and every worker exits 0."""
    graph, plan = mlp_job(tmp_path, 2)
    # Rank 0 slowed 40x (timing only) until the coordinator continues, so the job is still running then on any
    # machine (a few steps a second; unslowed, 250-750 steps/s), then at full speed (`release`).
    steps = 600
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        proxy = CuttingProxy(coord.address)
        try:
            commands = worker_commands(args(plan, steps, "--coordinator", coord.address, "--token", TOKEN,
                                            "--slowdown", 40, "--slowdown_rank", 0), 2)
            commands[1][commands[1].index(coord.address)] = proxy.address  # rank 1 talks through the proxy
            with LocalWorld(commands) as world:
                world.wait_for_line(0, r"step 3 loss", timeout=120)
                proxy.cut()
                world.wait_for_line(1, r"rank 1 reconnected to the coordinator", timeout=30)
                assert coord.proc is not None
                os.killpg(coord.proc.pid, signal.SIGSTOP)
                try:
                    time.sleep(8)  # the fault itself: the coordinator stands still for 8 s
                    alive = [p.poll() is None for p in world.procs]
                finally:
                    os.killpg(coord.proc.pid, signal.SIGCONT)
                release(coord, world)
                result = world.wait(timeout=180)
            code = coord.wait(timeout=30)
        finally:
            proxy.close()
    assert all(alive), f"the job ended while the coordinator was stopped; raise `steps`:\n{result.summary()}"
    assert result.ok, result.summary()
    for rank in range(2):
        assert re.search(rf"\[rank {rank} stage {rank}\] done: {steps} step\(s\)", result.output(rank)), result.summary()
    assert "rank 1 lost the coordinator" in result.output(1), result.summary()
    log = coord.output()
    assert "rank 1 reconnected" in log and re.search(r"the coordinator was paused for \d+\.\d s", log), log
    assert "no heartbeat" not in log, f"a paused coordinator must not judge the workers' silence:\n{log}"
    assert code == 0, f"coordinator exit {code}:\n{log}"


def test_bad_reports_are_rejected_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """Authenticated reports with absurd values: counted and logged once, never a crash or a stop; a NaN (the
    protocol refuses non-finite numbers) costs the sender its connection, and it reconnects."""
    from model_parallel.coordinator import policy as pol
    from model_parallel.coordinator.client import CoordinatorChannel
    from model_parallel.coordinator.protocol import C2S, HEADER, SEQ, compute_mac
    from model_parallel.coordinator.server import Coordinator
    from model_parallel.coordinator.solver import default_solver

    caplog.set_level(logging.DEBUG, logger="model_parallel.coordinator")
    graph, plan = chain_plan()
    coordinator = Coordinator(graph, plan, TOKEN.encode(), policy="auto",
                              config=pol.PolicyConfig(threshold=0.1, cooldown_steps=2, window=3), heartbeat_timeout=5,
                              solver=default_solver)
    address = f"127.0.0.1:{coordinator.start('127.0.0.1', 0)}"
    ch0 = CoordinatorChannel(address, TOKEN.encode(), rank=0, world_size=2)
    ch1 = CoordinatorChannel(address, TOKEN.encode(), rank=1, world_size=2)
    try:
        for step in range(4):
            ch0.report(metrics(0, step, 0, 0.004))
            ch1.report(metrics(1, step, 0, 0.004))
        wait_for(lambda: all(w.step == 3 for w in coordinator.workers.values()), what="good reports")
        session = ch1.session
        assert session is not None
        bad = [dict(compute_ms=1e308), dict(compute_ms=-3.0), dict(samples_per_s=-1.0), dict(comm_ms=1e300, idle_ms=-50.0)]
        with ch1._send_lock:
            for step, values in enumerate(bad, start=4):
                fields = {"rank": 1, "step": step, "stage": 1, "plan_version": 0, "step_ms": 20.0, "compute_ms": 4.0, "comm_ms": 1.0,
                          "idle_ms": 0.0, "samples_per_s": 400.0, **values}
                session.send("report", **fields)
        wait_for(lambda: coordinator.workers[1].bad_reports == len(bad), what="bad reports counted")
        assert coordinator.workers[1].status == "running" and coordinator.stop_reason is None
        assert caplog.text.count("rejected a bad report") == len(bad)
        assert "compute_ms=1e+308 exceeds" in caplog.text and "compute_ms=-3 is negative" in caplog.text
        assert all(r.compute_ms < 1e6 for r in coordinator.workers[1].reports)  # none reached the policy's samples
        for step in range(8, 16):  # the policy keeps deciding on good reports
            ch0.report(metrics(0, step, 0, 0.004))
            ch1.report(metrics(1, step, 0, 0.004))
        wait_for(lambda: coordinator.workers[1].step == 15, what="reports after the bad ones")
        assert coordinator.last_decision != "no decision yet"

        # NaN: refused by the frame decoder (the protocol allows no non-finite number) -> connection dropped.
        body = json.dumps({"v": 1, "type": "report", "seq": session.send_seq + 1, "rank": 1, "step": 16, "stage": 1,
                           "plan_version": 0, "step_ms": 20.0, "compute_ms": float("nan"), "comm_ms": 1.0, "idle_ms": 0.0,
                           "samples_per_s": 1.0}).encode()
        with ch1._send_lock:
            session.send_seq += 1
            mac = compute_mac(TOKEN.encode(), C2S, session.nonce, session.send_seq, body)
            session.sock.sendall(HEADER.pack(len(mac) + SEQ.size + len(body)) + mac + SEQ.pack(session.send_seq) + body)
        wait_for(lambda: ch1.reconnects == 1, timeout=15, what="rank 1 reconnected after its NaN frame")
        wait_for(lambda: coordinator.workers[1].status == "running", what="rank 1 running again")
        assert "NaN is not a number JSON allows" in caplog.text
        assert coordinator.stop_reason is None
        assert all(c is None or c.kind != "stop" for c in (ch0.poll(), ch0.poll(), ch1.poll())), "nobody is stopped"
    finally:
        ch0.close()
        ch1.close()
        coordinator.stop()
    assert coordinator.workers[0].status == coordinator.workers[1].status == "finished"


# ---- a stalled or dead rank is named, within 1.5 x --timeout ----------------------------------------------------
def test_sigstop_of_a_worker_is_named_by_every_other_process_and_by_itself(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 3)
    with LocalWorld(worker_commands(args(plan, 100_000), 3)) as world:
        world.wait_for_line(0, r"step 5 loss", timeout=120)
        world.kill(1, signal.SIGSTOP)
        stopped = time.monotonic()
        times = exit_times(world, [0, 2], stopped, timeout=3 * TIMEOUT)
        world.kill(1, signal.SIGCONT)  # continued: it must blame itself, not the ranks that gave up on it
        times.update(exit_times(world, [1], stopped, timeout=30))
        result = world.wait(timeout=10)
    assert sorted(times) == [0, 1, 2], f"still running after the deadline: {times}\n{result.summary()}"
    for rank in (0, 2):
        assert times[rank] <= BOUND, f"rank {rank} ended {times[rank]:.1f} s after the SIGSTOP (> {BOUND} s)\n{result.summary()}"
        assert result.workers[rank].returncode == EXIT_PEER, result.summary()
        assert "rank 1 stopped responding (last heartbeat" in error_line(result.output(rank)), result.summary()
    line = error_line(result.output(1))
    assert result.workers[1].returncode == EXIT_PEER, result.summary()
    assert re.search(r"rank 1 stopped responding: this process stood still for \d+\.\d s", line), line
    assert "rank 0 stopped" not in line and "rank 2 stopped" not in line, line


def test_sigstop_of_rank0_the_store_host_ends_the_others_within_bound(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    with LocalWorld(worker_commands(args(plan, 100_000), 2)) as world:
        world.wait_for_line(0, r"step 5 loss", timeout=120)
        world.kill(0, signal.SIGSTOP)
        stopped = time.monotonic()
        times = exit_times(world, [1], stopped, timeout=3 * TIMEOUT)
        world.kill(0, signal.SIGCONT)
        result = world.wait(timeout=30)
    assert 1 in times and times[1] <= BOUND, f"rank 1 ended {times} s after the SIGSTOP (> {BOUND} s)\n{result.summary()}"
    assert result.workers[1].returncode == EXIT_PEER, result.summary()
    assert "rank 0 stopped responding (it hosts the rendezvous store" in error_line(result.output(1)), result.summary()
    assert result.workers[0].returncode == EXIT_PEER, result.summary()
    assert "rank 0 stopped responding: this process stood still" in error_line(result.output(0)), result.summary()


def test_kill9_of_rank0_mid_step_is_named_without_cpp_stack_frames(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 3)
    # "": no explicit level, so the worker's own default applies (LocalWorld would otherwise set one).
    with LocalWorld(worker_commands(args(plan, 100_000), 3), env={"TORCH_CPP_LOG_LEVEL": ""}) as world:
        world.wait_for_line(0, r"step 5 loss", timeout=120)
        world.kill(0)  # training never pauses between steps: rank 0 dies mid-step
        killed = time.monotonic()
        times = exit_times(world, [1, 2], killed, timeout=3 * TIMEOUT)
        result = world.wait(timeout=10)
    for rank in (1, 2):
        output = result.output(rank)
        assert rank in times and times[rank] <= BOUND, f"rank {rank}: {times}\n{result.summary()}"
        assert result.workers[rank].returncode == EXIT_PEER, result.summary()
        assert "rank 0 stopped responding (it hosts the rendezvous store" in error_line(output), output[-3000:]
        assert "frame #" not in output and "Traceback" not in output, output[-3000:]


# ---- exit codes ----------------------------------------------------------------------------------------------
def test_a_run_stopped_before_its_steps_exits_4_with_the_reason(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    script = tmp_path / "stop.json"
    script.write_text(json.dumps({"3": {"kind": "stop", "reason": "the operator asked"}}))
    with LocalWorld(worker_commands(args(plan, 10, "--control_script", script), 2)) as world:
        result = world.wait(timeout=120)
    for rank in range(2):
        assert result.workers[rank].returncode == EXIT_STOPPED, result.summary()
        assert error_line(result.output(rank)).endswith(
            f"[rank {rank} stage {rank}] stopped after 3 of the 10 requested step(s): the operator asked"), result.summary()
        assert "done:" not in result.output(rank)


# ---- flat memory -----------------------------------------------------------------------------------------------
def test_metrics_records_are_a_bounded_window_and_the_file_keeps_all(tmp_path: Path) -> None:
    from model_parallel.runtime.observe.metrics import MetricsRecorder
    from model_parallel.runtime.observe.metrics_read import read_metrics

    with MetricsRecorder(0, path=tmp_path / "rank{rank}.jsonl", window=5) as recorder:
        for step in range(12):
            recorder.begin_step(step)
            recorder.end_step(samples=8)
    assert [r.step for r in recorder.records] == list(range(7, 12))
    assert [r["step"] for r in read_metrics(tmp_path / "rank0.jsonl")] == list(range(12))


def test_engine_history_is_bounded_and_the_trainer_stops_its_heartbeat(tmp_path: Path) -> None:
    """The memory benchmark's smoke run: one rank's PipelineTrainer, a window of 50 over 300 steps."""
    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "memory_flat.py"), "--steps", "300", "--window", "50",
                          "--sample_every", "100", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["history_len"], result["records_len"], result["jsonl_lines"]) == (50, 50, 300), result
    assert result["heartbeat_alive_after_close"] is False
