"""The unit tier starts no process: a unit test (not marked slow) that tries fails with what it started."""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(
            f"a unit test started a process ({what} {args[1:2] or ''}); tests under tests/unit start none: "
            "move the test to tests/integration/ (and mark it slow)"
        )
    return refuse


@pytest.fixture(autouse=True)
def _no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # Slow tests still waiting in a unit file for their move to tests/integration are left alone.
    if request.node.get_closest_marker("slow") is not None:
        return
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing"))
    monkeypatch.setattr(os, "fork", _refuse("os.fork"))
