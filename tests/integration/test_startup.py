"""A world that never fully starts: a worker that leaves right after joining (the coordinator refuses it), the
store host doing so, a worker that never joins (it cannot use the coordinator). Every other rank exits 3 within about 1.5 x --timeout naming the
rank (docs/reliability.md, the table under "Failures while training"), instead of waiting out torch's 30-minute default in
`new_group` or failing with a raw DistNetworkError as if its own code had failed (exit 5)."""
from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from model_parallel.coordinator.client import CoordinatorChannel
from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.runtime.launch import LocalWorld, free_port, worker_commands
from support.mlp import mlp_job

TOKEN = "startup-test-token"
TIMEOUT = 6  # --timeout of every worker
DID_NOT_HANG = TIMEOUT + 50  # generous: the old code waited 30 minutes here
EXIT_USAGE, EXIT_PEER = 2, 3
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def args(plan: Path, *extra: object) -> list[str]:
    return ["--model", "mlp", "--plan", str(plan), "--steps", "3", "--batch_size", "8", "--num_microbatches", "4",
            "--timeout", str(TIMEOUT), *map(str, extra)]


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if re.match(r"\[rank \d+\] error: ", line)]
    assert len(lines) == 1, f"expected one error line, got {lines}:\n{output[-3000:]}"
    return lines[0]


def with_coordinator(commands: list[list[str]], address: str, bad_rank: int, bad: list[str]) -> list[list[str]]:
    """Every rank talks to the coordinator at `address`; `bad_rank` gets the flags `bad` instead."""
    return [[*command, *(bad if rank == bad_rank else ["--coordinator", address, "--token", TOKEN])]
            for rank, command in enumerate(commands)]


@pytest.mark.parametrize("bad_rank", [1, 0], ids=["a worker", "the store host"])
def test_a_rank_that_leaves_right_after_joining_is_named(tmp_path: Path, bad_rank: int) -> None:
    """A rank the coordinator refuses at registration, after it joined the world (here: its rank is registered
    and alive already, a second worker started for it): it exits 2 and publishes why; its peers, waiting for it in
    the engine's `new_group`, exit 3 after --timeout naming it (with the store host as the one that left, exit 5
    with a raw DistNetworkError before)."""
    graph, plan = mlp_job(tmp_path, 3)
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        holder = CoordinatorChannel(coord.address, TOKEN.encode(), rank=bad_rank, world_size=3, timeout=10)
        try:
            commands = with_coordinator(worker_commands(args(plan), 3), coord.address, bad_rank,
                                        ["--coordinator", coord.address, "--token", TOKEN])
            with LocalWorld(commands) as world:
                result = world.wait(timeout=DID_NOT_HANG)
        finally:
            holder.close()
    assert not result.timed_out, result.summary()
    assert result.workers[bad_rank].returncode == EXIT_USAGE, result.summary()
    assert f"refused rank {bad_rank}: rank {bad_rank} is already registered and alive" in result.output(bad_rank)
    for rank in range(3):
        if rank == bad_rank:
            continue
        assert result.workers[rank].returncode == EXIT_PEER, result.summary()
        line = error_line(result.output(rank))
        assert f"rank {bad_rank} failed: ProtocolError: coordinator at {coord.address} refused rank {bad_rank}" in line, line
        assert "Traceback" not in result.output(rank), result.output(rank)[-3000:]


@pytest.mark.parametrize("fault", ["nothing listens", "a wrong token"])
def test_a_worker_that_cannot_use_the_coordinator_never_joins(tmp_path: Path, fault: str) -> None:
    """Before joining the world it waits up to --timeout for the coordinator to listen, and has it answer a message
    signed with its token; then exits 2 naming the address (or the token), and its peers exit 3 naming it as a rank
    that never joined (they waited 30 minutes in `new_group`; a wrong token was refused only after joining)."""
    graph, plan = mlp_job(tmp_path, 2)
    nowhere = f"127.0.0.1:{free_port()}"
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        bad = (["--coordinator", nowhere, "--token", TOKEN] if fault == "nothing listens"
               else ["--coordinator", coord.address, "--token", "not-the-token"])
        commands = with_coordinator(worker_commands(args(plan), 2), coord.address, 1, bad)
        with LocalWorld(commands) as world:
            result = world.wait(timeout=DID_NOT_HANG)
    assert not result.timed_out, result.summary()
    assert result.workers[1].returncode == EXIT_USAGE, result.summary()
    if fault == "nothing listens":
        assert f"cannot reach the coordinator at {nowhere}" in result.output(1), result.summary()
        assert f"nothing listens at the coordinator's address {nowhere} yet" in result.output(1), result.summary()
    else:
        assert (f"error: the coordinator at {coord.address} hung up on rank 1's first message without an answer" in
                result.output(1)), result.summary()
        assert "this worker's token is not the coordinator's" in result.output(1), result.summary()
    assert result.workers[0].returncode == EXIT_PEER, result.summary()
    assert "rank(s) [1] never joined" in error_line(result.output(0)), result.summary()


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_every_rank_names_the_rank_that_never_joined(tmp_path: Path) -> None:
    """Rank 1 starts after rank 0 hosts the store, so its join times out later than rank 0's: rank 0 keeps the
    store up until rank 1 has read who is missing (it exited at once, and rank 1 printed a thread's traceback)."""
    _, plan = mlp_job(tmp_path, 3)
    port = free_port()
    commands = worker_commands(args(plan), 3, port=port)
    with LocalWorld(commands[:1]) as first:
        deadline = time.monotonic() + 60
        while not accepts(port):  # rank 0 hosts the store now
            assert first.procs[0].poll() is None and time.monotonic() < deadline, first.lines(0)
            time.sleep(0.05)
        with LocalWorld(commands[1:2]) as second:
            late = second.wait(timeout=DID_NOT_HANG)
        early = first.wait(timeout=DID_NOT_HANG)
    for result in (early, late):
        assert not result.timed_out, result.summary()
        assert result.workers[0].returncode == EXIT_PEER, result.summary()
        output = result.output(0)
        assert "not every one of the 3 ranks joined within 6 s: rank(s) [2] never joined" in error_line(output), output
        assert "Traceback" not in output and "Exception in thread" not in output, output[-3000:]
