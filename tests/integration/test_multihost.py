"""Training across real network hosts: network namespaces with their own IP addresses (tests/support/netns.py).

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from support import REPO

from support import REFERENCE_PROFILES, netns
from support.mlp import assert_params_close, mlp_job, reference_params

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"multi-host tests need network namespaces: {REASON}"),
              pytest.mark.timeout(120), pytest.mark.slow]
PYTHON = sys.executable

ALL_REDUCE = textwrap.dedent("""
    import sys, datetime, torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world, addr, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    peer = torch.zeros(1)
    # A point-to-point exchange too: rank 0 <-> rank 1 is what pipeline stages do.
    if rank == 0:
        dist.send(torch.tensor([42.0]), 1); dist.recv(peer, 1)
    elif rank == 1:
        dist.recv(peer, 0); dist.send(torch.tensor([43.0]), 0)
    print(f"rank={rank} sum={t.tolist()} peer={peer.item()}", flush=True)
    dist.destroy_process_group()
""")


def test_namespaces_are_separate_hosts_and_torn_down() -> None:
    with netns.hosts(2) as net:
        names = [h.namespace for h in net.hosts] + [net.switch]
        address = net.run(1, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert "10.200.0.2/24" in address
        # Host 0 cannot see host 1's address as its own: they are different network stacks.
        assert "10.200.0.2" not in net.run(0, ["ip", "-4", "-o", "addr"]).stdout
    left = set(netns._list_namespaces())
    assert not left & set(names), f"namespaces not removed: {left & set(names)}"


def test_teardown_happens_on_failure() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with netns.hosts(1) as net:
            names = [net[0].namespace, net.switch]
            net.spawn(0, [PYTHON, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("boom")
    assert not set(netns._list_namespaces()) & set(names)


def test_gloo_all_reduce_across_two_hosts(tmp_path: Path) -> None:
    with netns.hosts(2) as net:
        master = net[0].address
        logs = [tmp_path / f"host{i}.log" for i in range(2)]
        for rank in range(2):
            net.spawn(rank, [PYTHON, "-c", ALL_REDUCE, str(rank), "2", master, "29531"], log=logs[rank])
        codes = net.wait_all(timeout=90)
        outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    assert "rank=0 sum=[3.0, 3.0, 3.0, 3.0] peer=43.0" in outputs[0]
    assert "rank=1 sum=[3.0, 3.0, 3.0, 3.0] peer=42.0" in outputs[1]


GRAPH = REFERENCE_PROFILES / "vgg16_partitioned_3stages.graph.txt"
TOKEN = "multihost-secret"

HOSTILE_CLIENT = textwrap.dedent("""
    import socket, struct, sys
    host, port = sys.argv[1], int(sys.argv[2])
    def attempt(payload):
        with socket.create_connection((host, port), timeout=10) as s:
            s.settimeout(10)
            s.recv(4096)  # the server's hello
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)  # end of our input: the server sees a cut frame at once
                while s.recv(4096):  # the server must drop us
                    pass
            except OSError:  # the server may drop us before we finish: that is the point
                pass
    body = b'{"v":1,"type":"ctl","seq":1,"op":"status","args":{}}'
    attempt(struct.pack(">I", 32 + len(body)) + bytes(32) + body)  # unauthenticated (zero MAC)
    attempt(struct.pack(">I", 1 << 30))                          # oversized length
    attempt(struct.pack(">I", 32 + 100) + bytes(40))                # truncated, then closed
    attempt(b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")               # garbage
    deep = b"[" * 200000 + b"]" * 200000
    attempt(struct.pack(">I", 32 + len(deep)) + bytes(32) + deep)    # nested past json's recursion limit
    print("hostile client done", flush=True)
""")


def wait_for_text(path: Path, text: str, timeout: float, process) -> str:
    """Poll a log file until `text` appears; fail early if the process died, or at the deadline."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if process.poll() is not None:
            raise AssertionError(f"process exited ({process.returncode}) before printing {text!r}:\n{content}")
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not seen in {path} within {timeout} s")


def test_coordinator_on_one_host_ctl_and_hostile_client_on_others(tmp_path: Path) -> None:
    with netns.hosts(3) as net:
        coordinator_address = net[0].address
        log = tmp_path / "coordinator.log"
        coordinator = net.spawn(0, [PYTHON, str(REPO / "test_socket.py"), "--host", coordinator_address, "--port", "29600",
                                    "--token", TOKEN, "--graph", str(GRAPH), "--plan", str(GRAPH), "--timeout", "90"], log=log)
        wait_for_text(log, "coordinator listening", 60, coordinator)
        ctl = [PYTHON, "-m", "model_parallel.cli.main", "ctl", "--address", f"{coordinator_address}:29600", "--token", TOKEN,
               "--timeout", "20", "--json", "status"]
        before = net.run(1, ctl, timeout=60)
        assert before.returncode == 0, before.stderr
        assert '"plan_version": 0' in before.stdout.replace('"plan_version":0', '"plan_version": 0')
        hostile = net.run(2, [PYTHON, "-c", HOSTILE_CLIENT, coordinator_address, "29600"], timeout=60)
        assert "hostile client done" in hostile.stdout, hostile.stderr
        wrong = net.run(1, ctl[:ctl.index("--token") + 1] + ["wrong-token"] + ctl[ctl.index("--token") + 2:], timeout=60)
        assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
        after = net.run(1, ctl, timeout=60)
        assert after.returncode == 0, f"coordinator stopped answering after hostile input: {after.stderr}"
        coordinator.terminate()
        net.wait_all(timeout=30)
        output = log.read_text()
    assert "Traceback" not in output, output
    for reason in ("authentication failed", "exceeds the", "truncated frame"):
        assert f"dropped client {net[2].address}" in output and reason in output, f"no drop logged for {reason!r}:\n{output}"


def test_coordinator_and_workers_on_separate_hosts_train_exactly(tmp_path: Path) -> None:
    """The seed's command lines across three hosts: coordinator on 10.200.0.1, rank 0 on .2, rank 1 on .3."""
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    steps, batch, micro, lr = 4, 8, 4, 0.01
    graph, plan = mlp_job(tmp_path, 2, batch, micro)
    checkpoints = tmp_path / "ck"
    with netns.hosts(3) as net:
        coord_addr, rank0_addr = net[0].address, net[1].address
        logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "rank0", "rank1")}
        coordinator = net.spawn(0, [PYTHON, str(REPO / "test_socket.py"), "--host", coord_addr, "--port", "29600", "--token", TOKEN,
                                    "--graph", str(graph), "--plan", str(plan), "--policy", "manual", "--timeout", "150"],
                                log=logs["coordinator"])
        wait_for_text(logs["coordinator"], "coordinator listening", 60, coordinator)
        for rank in range(2):
            net.spawn(rank + 1, [PYTHON, str(REPO / "test_parallel_0.py"), "--rank", rank, "--world_size", 2,
                                 "--dist_addr", rank0_addr, "--dist_port", 29500, "--model", "mlp", "--plan", plan,
                                 "--steps", steps, "--batch_size", batch, "--num_microbatches", micro, "--lr", lr,
                                 "--checkpoint_dir", checkpoints, "--timeout", 60,
                                 "--coordinator", f"{coord_addr}:29600", "--token", TOKEN], log=logs[f"rank{rank}"])
        try:
            codes = net.wait_all(timeout=150)
        finally:
            outputs = {name: log.read_text(errors="replace") for name, log in logs.items() if log.exists()}
    assert codes == [0, 0, 0], "\n".join(f"--- {k}\n{v[-2000:]}" for k, v in outputs.items())
    for rank in range(2):
        assert f"rank {rank} registered" in outputs["coordinator"] and f"rank {rank} finished" in outputs["coordinator"]
    got = load_checkpoint(checkpoints).params()
    assert_params_close(got, reference_params(steps, batch, micro, lr), "multi-host run")


def test_torchrun_across_two_hosts(tmp_path: Path) -> None:
    """`torchrun --nnodes=2` with one worker per host (static rendezvous at host 0's address)."""
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    steps = 3
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    with netns.hosts(2) as net:
        logs = [tmp_path / f"node{i}.log" for i in range(2)]
        for node in range(2):
            net.spawn(node, [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
                             f"--master_addr={net[0].address}", "--master_port=29510",
                             str(REPO / "test_parallel_0.py"), "--model", "mlp", "--plan", str(plan), "--steps", str(steps),
                             "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01",
                             "--checkpoint_dir", str(checkpoints), "--timeout", "60"], log=logs[node])
        try:
            codes = net.wait_all(timeout=150)
        finally:
            outputs = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert_params_close(load_checkpoint(checkpoints).params(), reference_params(steps), "torchrun multi-host run")


def test_network_partition_ends_both_sides_with_a_message(tmp_path: Path) -> None:
    """Unlike kill -9 (the kernel resets the connections), a cut link sends nothing: only timeouts notice."""
    import subprocess

    from model_parallel.runtime.checkpoint.store import load_checkpoint

    peer_timeout = 5
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    with netns.hosts(2) as net:
        logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
        processes = [net.spawn(rank, [PYTHON, str(REPO / "test_parallel_0.py"), "--rank", rank, "--world_size", 2,
                                      "--dist_addr", net[0].address, "--dist_port", 29500, "--model", "mlp", "--plan", plan,
                                      "--steps", 100_000, "--checkpoint_dir", checkpoints, "--checkpoint_every", 3,
                                      "--timeout", peer_timeout], log=logs[rank]) for rank in range(2)]
        wait_for_text(logs[0], "checkpoint step 2 committed", 120, processes[0])
        cut = net.run(1, ["ip", "link", "set", "eth0", "down"])  # rank 1's host drops off the network
        assert cut.returncode == 0, cut.stderr
        try:
            processes[0].wait(timeout=peer_timeout * 4 + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running {peer_timeout * 4 + 20} s after the cut:\n{logs[0].read_text()[-2000:]}")
        rank0 = logs[0].read_text(errors="replace")
        assert processes[0].returncode != 0
        assert any("rank 1" in line for line in rank0.splitlines() if "error" in line.lower()), rank0[-2000:]
        load_checkpoint(checkpoints)  # the last committed checkpoint is intact
        try:
            # Its store calls are bounded by --timeout (runtime/wire/health.py), so it cannot hang on the lost store host.
            processes[1].wait(timeout=peer_timeout * 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the cut-off rank 1 still running {peer_timeout * 2} s after rank 0 exited:\n{logs[1].read_text()[-2000:]}")
        rank1 = logs[1].read_text(errors="replace")
    assert processes[1].returncode != 0
    assert any("rank 0" in line for line in rank1.splitlines() if "error" in line.lower()), rank1[-2000:]
