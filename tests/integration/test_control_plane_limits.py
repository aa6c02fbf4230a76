"""A worker process joins with a token file, and ps does not show the token."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_parallel.coordinator import policy as pol
from support import REPO
from support.coordinators import live_coordinator


TOKEN = b"limits-token"


# ---- a live coordinator under a flood of idle connections --------------------------------------------------
@pytest.fixture
def coordinator():
    with live_coordinator(TOKEN, policy="manual", config=pol.PolicyConfig(window=3), heartbeat_timeout=30) as coord:
        yield coord


# ---- the token stays off the command line --------------------------------------------------------------
@pytest.mark.slow
def test_worker_with_token_file_joins_and_ps_does_not_show_the_token(coordinator, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN.decode() + "\n")
    token_file.chmod(0o600)
    code = ("import sys, time\n"
            "from model_parallel.cli.worker import build_parser, make_channel\n"
            "args = build_parser().parse_args(sys.argv[1:])\n"
            "channel = make_channel(args, 1, 2)\n"
            "print('joined', channel.plan_version, flush=True)\n"
            "sys.stdin.readline()\n"
            "channel.close()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MODEL_PARALLEL_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-c", code, "--coordinator", coordinator.address, "--token-file", str(token_file)],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "joined 0", proc.stderr.read() if proc.poll() is not None else ""
        assert coordinator.workers[1].status == "running" and coordinator.workers[1].pid == proc.pid
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert TOKEN not in argv and str(token_file).encode() in argv
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
