"""Run one command to completion under a deadline (its whole process group killed then), for tests."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

import pytest


def run_to_completion(argv: list[str], cwd: Path, env: Optional[dict[str, str]] = None, timeout: float = 180,
                      what: Optional[str] = None) -> str:
    """The command's output (stdout and stderr together); fails the test on a non-zero exit or at the deadline."""
    what = what or " ".join(argv)
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        pytest.fail(f"{what} still running after {timeout} s:\n{output[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    assert process.returncode == 0, f"{what} exited {process.returncode}:\n{output[-3000:]}"
    return output
