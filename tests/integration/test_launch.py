"""The launcher's process handling: output collected, stuck workers killed at the deadline, an early exit
reported while waiting for a line."""
from __future__ import annotations

import sys

import pytest

from model_parallel.errors import PeerError
from model_parallel.runtime.launch import LocalWorld, launch


@pytest.mark.slow  # starts a process
def test_launcher_wait_for_line_reports_an_early_exit():
    with LocalWorld([[sys.executable, "-c", "print('bye')"]]) as world:
        with pytest.raises(PeerError, match=r"worker 0 exited \(0\) before printing /never/"):
            world.wait_for_line(0, "never", timeout=30)


@pytest.mark.slow
# ---- launcher --------------------------------------------------------------------------------------
def test_launcher_collects_output_and_kills_at_the_deadline():
    ok = [sys.executable, "-c", "print('hello')"]
    stuck = [sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(60)"]
    result = launch([ok, stuck], timeout=5)
    assert result.timed_out and not result.ok
    assert result.workers[0].returncode == 0 and result.output(0) == "hello"
    assert result.workers[1].killed and result.output(1) == "waiting"
    assert "TIMED OUT" in result.summary()
