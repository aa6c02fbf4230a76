"""Start the coordinator (`test_socket.py`) as a local subprocess with a deadline; always reaped.

For tests, benchmarks and the demo:

    with CoordinatorProcess(graph="g.json", plan="p.json", token="t", extra=["--window", "3"]) as coord:
        ... start workers with --coordinator coord.address --token t ...
        coord.ctl("status")            # the ctl client, in process
        coord.wait(timeout=60)         # exits by itself once every worker finished
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

from model_parallel.errors import PeerError

REPO_ROOT = Path(__file__).resolve().parents[2]
# `model-parallel coordinator` (= the seed's test_socket.py) as `python -m`, run from REPO_ROOT: this checkout.
COMMAND = ("-m", "model_parallel.cli.main", "coordinator")


class CoordinatorProcess:
    """`model-parallel coordinator --port 0 ...` in its own session; `address` once it listens."""

    def __init__(self, graph: Union[str, Path], plan: Union[str, Path], token: str, *, workdir: Union[str, Path],
                 extra: Sequence[str] = (), host: str = "127.0.0.1", start_timeout: float = 30.0) -> None:
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port_file = self.workdir / "coordinator.port"
        self.status_file = self.workdir / "coordinator_status.json"
        self.token = token
        self.host = host
        self.start_timeout = start_timeout
        self.command = [sys.executable, *COMMAND, "--host", host, "--port", "0", "--port-file", str(self.port_file),
                        "--token", token, "--graph", str(Path(graph).resolve()), "--plan", str(Path(plan).resolve()),
                        "--status-file", str(self.status_file), *map(str, extra)]
        self.proc: Optional[subprocess.Popen] = None
        self.lines: list[str] = []
        self._reader: Optional[threading.Thread] = None
        self.address = ""

    def start(self) -> "CoordinatorProcess":
        self.port_file.unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.command, cwd=str(REPO_ROOT), env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.start_timeout
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None:
                self.close()
                raise PeerError(f"the coordinator exited ({self.proc.returncode}) before listening:\n" + self.output())
            if time.monotonic() > deadline:
                self.close()
                raise PeerError(f"the coordinator did not listen within {self.start_timeout:.0f} s:\n" + self.output())
            time.sleep(0.05)
        self.address = f"{self.host}:{int(self.port_file.read_text().strip())}"
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def ctl(self, op: str, **args: Any) -> dict[str, Any]:
        from model_parallel.coordinator.client import CtlClient

        with CtlClient(self.address, self.token.encode("utf-8")) as client:
            return client.request(op, **args)

    def wait(self, timeout: float) -> Optional[int]:
        """Wait for the coordinator to exit by itself (all workers done); kill it at the deadline."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return None
        finally:
            if self._reader is not None:
                self._reader.join(timeout=5)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)

    def __enter__(self) -> "CoordinatorProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
