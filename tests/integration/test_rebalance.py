"""End to end with the seed's command lines: coordinator + workers rebalance live, exactly; bad clients; kill -9."""
import json
import socket
import struct
import threading
import time

import pytest
import torch

from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.coordinator.protocol import C2S, client_handshake, encode_frame, make_message
from model_parallel.graph.io import save_graph
from model_parallel.graph.plan import write_plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import latest_step, load_checkpoint
from model_parallel.runtime.launch import LocalWorld, worker_commands

pytestmark = pytest.mark.slow  # every test runs workers and a coordinator
torch.set_num_threads(1)
TOKEN = "rebalance-test-token"
BATCH, MICRO = 8, 4


def write_job(directory, num_stages):
    """graph.json of the built-in MLP exactly as the workers trace it, and an even plan."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(BATCH // MICRO))
    save_graph(graph, directory / "graph.json")
    write_plan(even_plan(graph, num_stages), directory / f"plan{num_stages}.json")
    return directory / "graph.json", directory / f"plan{num_stages}.json"


def worker_args(plan, steps, checkpoint_dir, *extra):
    return ["--model", "mlp", "--plan", str(plan), "--steps", str(steps), "--batch_size", str(BATCH),
            "--num_microbatches", str(MICRO), "--checkpoint_dir", str(checkpoint_dir), "--timeout", "30", *map(str, extra)]


def final_params(directory):
    return load_checkpoint(directory).params()


def bad_clients(address, stop):
    """Keep attacking the coordinator until `stop`: wrong token, oversized, truncated, garbage."""
    host, port = address.split(":")
    attacks = 0
    while not stop.is_set():
        for payload in (
            "wrong-token",
            struct.pack(">I", 1 << 31),
            struct.pack(">I", 500) + b"\x00" * 20,
            b"\x00\x00\x00\x30" + b"garbage!" * 6,
        ):
            try:
                with socket.create_connection((host, int(port)), timeout=5) as sock:
                    session = client_handshake(sock, b"whatever", 5)
                    if payload == "wrong-token":
                        message = make_message("register", 1, role="worker", rank=0, world_size=2)
                        payload = encode_frame(message, b"not-the-token", C2S, session.nonce)
                    sock.sendall(payload)
                attacks += 1
            except OSError:
                pass
        stop.wait(0.2)
    return attacks


def test_live_rebalance_is_exact_and_survives_bad_clients(tmp_path):
    graph, plan = write_job(tmp_path, 2)
    steps = 200
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path,
                            extra=["--window", "3", "--cooldown-steps", "3", "--threshold", "0.05"]) as coord:
        # rank 1 becomes 4x slower after step 2: the coordinator must move work to rank 0; then the
        # operator moves the pipeline onto one worker and back, while bad clients keep attacking.
        args = worker_args(plan, steps, tmp_path / "ck_live", "--coordinator", coord.address, "--token", TOKEN,
                           "--slowdown", "4", "--slowdown_rank", "1", "--slowdown_after_step", "2")
        stop = threading.Event()
        attacker = threading.Thread(target=bad_clients, args=(coord.address, stop), daemon=True)
        actions = []  # what the operator did, in order
        with LocalWorld(worker_commands(args, 2)) as world:
            attacker.start()
            try:
                deadline = time.monotonic() + 150
                while time.monotonic() < deadline and any(p.poll() is None for p in world.procs):
                    try:
                        status = coord.ctl("status")
                    except Exception:  # the coordinator exits when the workers finish
                        break
                    settled = status["pending_version"] is None
                    # 1. the policy moved work off slow rank 1 (v1): the operator shrinks onto one worker
                    if not actions and status["plan_version"] >= 1 and settled:
                        slowed_plan = status["plan"]
                        coord.ctl("scale", workers=1)
                        actions.append("scale 1")
                    # 2. that plan is live: bring the spare back (and undo the slowdown)
                    elif actions == ["scale 1"] and status["plan_version"] >= 2 and settled and len(status["plan"]["stages"]) == 1:
                        coord.ctl("slow", rank=1, factor=1.0)
                        coord.ctl("scale", workers=2)
                        actions.append("scale 2")
                    time.sleep(0.05)
                result = world.wait(timeout=max(10.0, deadline - time.monotonic()))
            finally:
                stop.set()
                attacker.join(timeout=10)
        assert result.ok, result.summary()
        assert coord.wait(timeout=20) == 0, coord.output()
    log = coord.output()
    assert "requesting plan v1" in log and "plan v1 is live" in log, log
    assert "dropped client" in log and "authentication failed" in log
    assert actions == ["scale 1", "scale 2"], (actions, log)
    assert "ctl scale --workers 1" in log and "ctl scale --workers 2" in log, log
    # the switch made while rank 1 was slow moved layers off rank 1
    v0 = json.loads(plan.read_text())
    assert len(slowed_plan["stages"][1]["node_ids"]) < len(v0["stages"][1]["node_ids"]), slowed_plan
    # automatic switch, shrink onto one worker, grow back: at least three live switches
    assert "plan v3 is live" in log, log

    reference = worker_args(plan, steps, tmp_path / "ck_ref")
    ref = LocalWorld(worker_commands(reference, 2)).start().wait(timeout=150)
    assert ref.ok, ref.summary()
    live, expected = final_params(tmp_path / "ck_live"), final_params(tmp_path / "ck_ref")
    assert sorted(live) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(live[name], value, rtol=1e-5, atol=1e-6, msg=f"parameter {name}")


def test_killed_worker_stops_all_and_resume_on_fewer_workers(tmp_path):
    graph, plan3 = write_job(tmp_path, 3)
    _, plan2 = write_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    with CoordinatorProcess(graph, plan3, TOKEN, workdir=tmp_path / "c1", extra=["--policy", "manual"]) as coord:
        args = worker_args(plan3, 100000, checkpoints, "--checkpoint_every", "5", "--coordinator", coord.address,
                           "--token", TOKEN, "--slowdown", "3", "--slowdown_rank", "0")
        with LocalWorld(worker_commands(args, 3)) as world:
            world.wait_for_line(0, r"checkpoint step 9 committed", timeout=120)
            world.kill(2)
            killed_wall = time.time()
            result = world.wait(timeout=60)
        assert coord.wait(timeout=20) is not None, coord.output()
    log = coord.output()
    # The coordinator notices (and only notes it: its peers, not the coordinator, end the run).
    notice = [line for line in log.splitlines() if "rank 2" in line and "is unreachable" in line]
    assert notice and "closed without a goodbye" in notice[0], log
    for rank in (0, 1):
        assert result.workers[rank].returncode == 3 and "rank 2 stopped responding" in result.output(rank), result.summary()
    # noticed within 10 s of the kill (log timestamps are HH:MM:SS, local time)
    noticed = time.strptime(notice[0].split()[0], "%H:%M:%S")
    killed = time.localtime(killed_wall)
    delay = (noticed.tm_hour * 3600 + noticed.tm_min * 60 + noticed.tm_sec) - (killed.tm_hour * 3600 + killed.tm_min * 60 + killed.tm_sec)
    assert -1 <= delay % 86400 <= 10 or delay % 86400 >= 86399, notice[0]
    assert all(w.returncode is not None for w in result.workers), result.summary()
    last = latest_step(checkpoints)
    assert last is not None and last >= 9
    load_checkpoint(checkpoints)  # intact

    # Resume on 2 workers: a fresh coordinator with a 2-stage plan; the run continues from the checkpoint.
    with CoordinatorProcess(graph, plan2, TOKEN, workdir=tmp_path / "c2") as coord:
        args = worker_args(plan2, last + 4, checkpoints, "--resume", "--coordinator", coord.address, "--token", TOKEN)
        resumed = LocalWorld(worker_commands(args, 2)).start().wait(timeout=120)
        assert resumed.ok, resumed.summary()
        assert coord.wait(timeout=20) == 0, coord.output()
    assert latest_step(checkpoints) == last + 3
