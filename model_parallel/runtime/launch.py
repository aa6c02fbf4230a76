"""Start a local world of worker processes with a deadline, collect their output, always reap them.

Used by tests, benchmarks and the demo:

    from model_parallel.runtime.launch import launch_workers
    result = launch_workers(["--model", "mlp", "--num_stages", "2", "--steps", "5"], world_size=2, timeout=120)
    assert result.ok, result.summary()

or, to act on a running world (kill a worker, wait for a log line):

    with LocalWorld(commands) as world:
        world.wait_for_line(1, "step 3", timeout=60)
        world.kill(1)
        result = world.wait(timeout=60)

Every worker gets `OMP_NUM_THREADS=1` and unbuffered output; each runs in its own session so a
kill reaches anything it started. Leaving the `with` block (or an exception) kills and reaps all.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from model_parallel.errors import PeerError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Workers start as `python -m model_parallel.cli.worker` (the seed's test_parallel_0.py runs the same), from
# REPO_ROOT (LocalWorld's default directory) so they import this checkout.
WORKER_MODULE = "model_parallel.cli.worker"


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class WorkerResult:
    rank: int
    returncode: Optional[int]  # None: still running when killed at the deadline
    output: str  # stdout and stderr, interleaved
    killed: bool = False  # killed by us (deadline or kill())


@dataclass(frozen=True)
class WorldResult:
    workers: tuple[WorkerResult, ...]
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(w.returncode == 0 for w in self.workers)

    def output(self, rank: int) -> str:
        return self.workers[rank].output

    def summary(self, tail_lines: int = 30) -> str:
        parts = [f"world of {len(self.workers)} finished in {self.seconds:.1f} s" + (" (TIMED OUT)" if self.timed_out else "")]
        for w in self.workers:
            tail = "\n".join(w.output.splitlines()[-tail_lines:])
            parts.append(f"--- rank {w.rank}: exit {w.returncode}{' (killed)' if w.killed else ''}\n{tail}")
        return "\n".join(parts)


class LocalWorld:
    """A set of worker processes started together; a context manager that always reaps them."""

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[Union[str, Path]] = None,
        echo: Optional[Callable[[int, str], None]] = None,
    ) -> None:
        self.commands = [list(map(str, c)) for c in commands]
        # TORCH_CPP_LOG_LEVEL=ERROR: a dead peer makes c10d print a C++ stack per failed store call.
        self.env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.cwd = str(cwd or REPO_ROOT)
        self.echo = echo
        self.procs: list[subprocess.Popen] = []
        self._lines: list[list[str]] = [[] for _ in self.commands]
        self._readers: list[threading.Thread] = []
        self._killed: set[int] = set()
        self._cond = threading.Condition()
        self._start = 0.0

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "LocalWorld":
        self._start = time.monotonic()
        try:
            for rank, command in enumerate(self.commands):
                proc = subprocess.Popen(
                    command, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                    start_new_session=True,  # own process group: a kill reaches its children too
                )
                self.procs.append(proc)
                reader = threading.Thread(target=self._read, args=(rank, proc), daemon=True)
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "LocalWorld":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            with self._cond:
                self._lines[rank].append(line)
                self._cond.notify_all()
            if self.echo is not None:
                self.echo(rank, line)

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (default SIGKILL) to one worker's process group."""
        proc = self.procs[rank]
        if proc.poll() is None:
            self._killed.add(rank)
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kill whatever still runs and reap everything (idempotent)."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.kill(rank)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                logger.error("worker pid %d did not die after SIGKILL", proc.pid)
        for reader in self._readers:
            reader.join(timeout=5)

    # ---- waiting ---------------------------------------------------------------------------------
    def lines(self, rank: int) -> list[str]:
        with self._cond:
            return list(self._lines[rank])

    def wait_for_line(self, rank: int, pattern: str, timeout: float) -> str:
        """Block until worker `rank` prints a line matching regex `pattern`; PeerError on timeout/exit."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self._lines[rank][seen:]:
                    if regex.search(line):
                        return line
                seen = len(self._lines[rank])
                if self.procs[rank].poll() is not None and not self._readers[rank].is_alive():
                    tail = "\n".join(self._lines[rank][-20:])
                    raise PeerError(f"worker {rank} exited ({self.procs[rank].returncode}) before printing /{pattern}/:\n{tail}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"worker {rank} did not print /{pattern}/ within {timeout:.0f} s")
                self._cond.wait(timeout=min(left, 0.5))

    def wait(self, timeout: float) -> WorldResult:
        """Wait for every worker to exit; at the deadline kill the rest. Always reaps."""
        deadline = time.monotonic() + timeout
        timed_out = False
        for proc in self.procs:
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(left, 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        self.close()
        workers = tuple(
            WorkerResult(rank, None if (timed_out and rank in self._killed) else proc.returncode,
                         "\n".join(self._lines[rank]), rank in self._killed)
            for rank, proc in enumerate(self.procs)
        )
        return WorldResult(workers, timed_out, time.monotonic() - self._start)


def worker_commands(
    args: Sequence[str],
    world_size: int,
    *,
    port: Optional[int] = None,
    module: str = WORKER_MODULE,
    python: str = sys.executable,
) -> list[list[str]]:
    """The command line of each rank: `python -m model_parallel.cli.worker --rank r --world_size N --dist_addr ...`."""
    port = port or free_port()
    return [
        [python, "-m", module, "--rank", str(rank), "--world_size", str(world_size),
         "--dist_addr", "127.0.0.1", "--dist_port", str(port), *map(str, args)]
        for rank in range(world_size)
    ]


def join_command(address: str, args: Sequence[str], *, module: str = WORKER_MODULE,
                 python: str = sys.executable) -> list[str]:
    """The command line of a worker joining a running `--recover` job at `address` (its store, HOST:PORT): the job's
    flags without `--recover` (docs/reliability.md, "Join"). From Python, start it as a process (`LocalWorld`,
    `subprocess`): `PipelineTrainer` cannot join (the same section says why)."""
    return [python, "-m", module, "--join", address, *(str(a) for a in args if a != "--recover")]


def launch(commands: Sequence[Sequence[str]], *, timeout: float, env: Optional[Mapping[str, str]] = None,
           echo: Optional[Callable[[int, str], None]] = None) -> WorldResult:
    """Run the commands as one world until all exit or `timeout` seconds pass (then kill them)."""
    with LocalWorld(commands, env=env, echo=echo) as world:
        return world.wait(timeout)


def launch_workers(args: Sequence[str], world_size: int, *, timeout: float, port: Optional[int] = None,
                   env: Optional[Mapping[str, str]] = None, echo: Optional[Callable[[int, str], None]] = None) -> WorldResult:
    """Start `world_size` workers (`python -m model_parallel.cli.worker`) with `args` on localhost and wait for them."""
    return launch(worker_commands(args, world_size, port=port), timeout=timeout, env=env, echo=echo)


def print_echo(rank: int, line: str) -> None:
    """An `echo` that prints each worker line as it arrives (for the demo and benchmarks)."""
    print(f"[worker {rank}] {line}", flush=True)
