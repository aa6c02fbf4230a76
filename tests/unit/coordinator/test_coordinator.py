"""Coordinator server + clients in one process: registration, reports, auto rebalance, ctl, bad clients, death."""
import logging
import socket
import struct
import time

import pytest
import torch

from model_parallel.cli.main import SUBCOMMANDS, build_parser
from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient
from model_parallel.coordinator.protocol import C2S, client_handshake, encode_frame, make_message
from model_parallel.errors import PlanError, ProtocolError
from model_parallel.graph.plan import Plan, StagePlan, write_plan
from model_parallel.messages import StepReport
from support import wait_for
from support.coordinators import chain_graph, live_coordinator, two_stage_plan

torch.set_num_threads(1)
TOKEN = b"test-token"


@pytest.fixture
def coordinator(tmp_path):
    with live_coordinator(TOKEN, chain_graph(8), policy="auto",
                          config=pol.PolicyConfig(threshold=0.1, cooldown_steps=2, window=3),
                          status_file=tmp_path / "status.json", heartbeat_timeout=1.5) as coord:
        yield coord


def cli_main(argv):
    """The console script minus its logging set-up (which would outlive capsys)."""
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


def metrics(rank, step, version, compute_s):
    return StepReport(rank=rank, step=step, plan_version=version, stage=rank, step_ms=20.0, compute_ms=compute_s * 1e3,
                      comm_ms=1.0, idle_ms=0.0, samples_per_s=400.0)




def test_auto_rebalance_switch_and_confirm(coordinator, tmp_path):
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2)
    ch1 = CoordinatorChannel(coordinator.address, TOKEN, rank=1, world_size=2)
    try:
        assert ch0.plan_version == 0 and Plan.from_dict(ch0.plan).num_stages == 2
        # rank 1 is twice as slow as rank 0 on the same amount of work
        command = None
        for step in range(40):
            ch0.report(metrics(0, step, 0, 0.004))
            ch1.report(metrics(1, step, 0, 0.008))
            command = wait_for(lambda: ch0.poll() or (step < 39 and "none"), timeout=0.5, what="poll") if step > 5 else ch0.poll()
            if command not in (None, "none"):
                break
            time.sleep(0.01)
        assert command is not None and command != "none" and command.kind == "switch"
        plan = command.plan
        assert plan.version == 1
        assert len(plan.stages[1].node_ids) < len(plan.stages[0].node_ids)  # work moved off rank 1
        assert ch1.poll() is None  # only rank 0 hears commands
        # the runtime applies it; reports with plan_version 1 confirm the switch
        ch0.report(metrics(0, 41, 1, 0.005))
        wait_for(lambda: coordinator.plan.version == 1, what="switch confirmation")
        with CtlClient(coordinator.address, TOKEN) as ctl:
            status = ctl.request("status")
        assert status["plan_version"] == 1 and status["history"][0]["applied_at_step"] == 41
        assert "time per minibatch" in status["table"]
        wait_for(lambda: (tmp_path / "status.json").exists(), what="status file")
    finally:
        ch0.close()
        ch1.close()
    assert coordinator.wait(5.0)  # both said bye


def test_bad_clients_are_dropped_and_do_not_disturb(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="model_parallel.coordinator.server")
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2)
    ch1 = CoordinatorChannel(coordinator.address, TOKEN, rank=1, world_size=2)
    host, port = coordinator.address.split(":")
    try:
        def attack(payload: bytes, hang_up=False):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                client_handshake(sock, b"ignored", 5)
                sock.sendall(payload)
                if hang_up:
                    return  # close in the middle of the frame
                sock.settimeout(5)
                try:
                    while sock.recv(4096):  # the server closes on us
                        pass
                except OSError:
                    pass

        register = make_message("register", 1, role="worker", rank=1, world_size=2)
        attack(encode_frame(register, b"wrong-token", C2S, "00" * 16))  # unauthenticated
        attack(struct.pack(">I", 1 << 30))  # oversized length
        attack(b"GET / HTTP/1.1\r\n\r\n")  # garbage
        attack(struct.pack(">I", 100) + b"x" * 10, hang_up=True)  # truncated, then closed
        for step in range(3):
            ch0.report(metrics(0, step, 0, 0.004))
            ch1.report(metrics(1, step, 0, 0.004))
        wait_for(lambda: all(w.step == 2 for w in coordinator.workers.values()), what="reports")
        assert all(w.status == "running" for w in coordinator.workers.values())
        assert coordinator.stop_reason is None and ch0.poll() is None
        wait_for(lambda: caplog.text.count("dropped client") >= 4, what="four drops logged")
        text = caplog.text
        assert "authentication failed" in text and "exceeds the 1048576-byte limit" in text
        assert "truncated frame: connection closed after 10 of 100 bytes" in text
    finally:
        ch0.close()
        ch1.close()


@pytest.mark.slow
def test_silent_and_vanished_workers_are_marked_unreachable_and_nothing_stops(coordinator):
    """The coordinator's view may be stale: it only marks such ranks unreachable (their peers name a dead one)."""
    coordinator.roster.world_size = 3  # rank 2 is a spare beside the 2-stage plan (Coordinator(world_size=3))
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=3)
    host, port = coordinator.address.split(":")
    silent = socket.create_connection((host, int(port)), timeout=5)
    vanished = socket.create_connection((host, int(port)), timeout=5)
    try:
        for rank, sock in ((1, silent), (2, vanished)):
            session = client_handshake(sock, TOKEN, 5)
            session.send("register", role="worker", rank=rank, world_size=3, host="h", pid=1)
            assert session.recv(5)["type"] == "welcome"
            session.send("report", **metrics(rank, 0, 0, 0.004).to_dict())  # it trained (one that never did is forgotten)
        wait_for(lambda: all(coordinator.workers[r].reports for r in (1, 2)), what="the first reports")
        vanished.close()  # like kill -9: the connection closes without a bye
        wait_for(lambda: coordinator.workers[2].status == "unreachable", timeout=5, what="vanished worker unreachable")
        wait_for(lambda: coordinator.workers[1].status == "unreachable", timeout=5, what="silent worker unreachable")
        assert "without a goodbye" in coordinator.workers[2].note and "no heartbeat for" in coordinator.workers[1].note
        assert coordinator.stop_reason is None and ch0.poll() is None  # nobody was told to stop
        assert coordinator.workers[0].status == "running"
        assert {w["rank"]: w["status"] for w in coordinator.handle_ctl("status", {})["workers"]} == {
            0: "running", 1: "unreachable", 2: "unreachable"}
    finally:
        silent.close()
        ch0.close()
    assert coordinator.wait(5.0)


def test_ctl_scale_slow_and_set_plan(coordinator, tmp_path, capsys):
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2)
    ch1 = CoordinatorChannel(coordinator.address, TOKEN, rank=1, world_size=2)
    try:
        for step in range(3):
            ch0.report(metrics(0, step, 0, 0.004))
            ch1.report(metrics(1, step, 0, 0.004))
        wait_for(lambda: all(w.step == 2 for w in coordinator.workers.values()), what="reports")
        base = ["ctl", "--address", coordinator.address, "--token", TOKEN.decode()]
        assert cli_main(base + ["status"]) == 0
        out = capsys.readouterr().out
        assert "plan v0" in out and "measured ms" in out and "spare" not in out
        assert cli_main(base + ["slow", "--rank", "1", "--factor", "2"]) == 0
        command = wait_for(ch0.poll, what="slowdown command")
        assert (command.kind, command.rank, command.factor) == ("slowdown", 1, 2.0)
        assert cli_main(base + ["scale", "--workers", "1"]) == 0
        command = wait_for(ch0.poll, what="scale command")
        plan = command.plan
        assert plan.num_stages == 1 and plan.stages[0].ranks == (0,) and plan.version == 1
        with pytest.raises(PlanError, match="still being applied"):
            coordinator.handle_ctl("scale", {"workers": 2})
        ch0.report(metrics(0, 3, 1, 0.004))
        wait_for(lambda: coordinator.plan.version == 1, what="confirmation")
        with pytest.raises(PlanError, match="between 1 and the 2 running"):
            coordinator.handle_ctl("scale", {"workers": 5})
        with pytest.raises(PlanError, match="scale --workers True: must be between"):  # not read as 1
            coordinator.handle_ctl("scale", {"workers": True})
        with pytest.raises(PlanError, match="slow: no worker with rank True"):
            coordinator.handle_ctl("slow", {"rank": True, "factor": 2})
        bad = Plan((StagePlan(0, ("input0", "n0"), ranks=(0,)),))
        write_plan(bad, tmp_path / "bad.json")
        with pytest.raises(PlanError, match="cover the graph's 9 nodes exactly"):
            cli_main(base + ["set-plan", str(tmp_path / "bad.json")])
        write_plan(two_stage_plan(coordinator.graph), tmp_path / "good.json")
        assert cli_main(base + ["set-plan", str(tmp_path / "good.json")]) == 0
        command = wait_for(ch0.poll, what="set-plan command")
        assert command.plan.num_stages == 2 and command.plan.version == 2
        with pytest.raises(ProtocolError, match="closed the connection"):
            cli_main(["ctl", "--address", coordinator.address, "--token", "nope", "status"])
    finally:
        ch0.close()
        ch1.close()


def test_worker_with_wrong_token_is_refused(coordinator):
    with pytest.raises(ProtocolError, match="refused rank 0"):
        CoordinatorChannel(coordinator.address, b"nope", rank=0, world_size=2, timeout=3)
    with pytest.raises(ProtocolError, match="cannot reach the coordinator"):
        CoordinatorChannel("127.0.0.1:1", TOKEN, rank=0, world_size=2, timeout=1)


def test_lost_coordinator_keeps_training(coordinator, caplog):
    ch0 = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2)
    try:
        coordinator.stop()
        wait_for(lambda: ch0.lost, timeout=5, what="lost connection")
        ch0.report(metrics(0, 1, 0, 0.001))  # does not raise
        assert ch0.poll() is None
        assert "lost the coordinator" in caplog.text
    finally:
        ch0.close()
