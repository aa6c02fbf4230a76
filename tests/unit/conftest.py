"""The unit tier starts no process: a unit test that tries fails with what it started."""
from __future__ import annotations

import multiprocessing.process
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from model_parallel.graph import render


# The standard library's own probes (platform.processor() runs `uname -p`, ctypes.util.find_library runs
# `ldconfig -p`) are not the tests' processes: they are let through.
PROBES = ("uname", "ldconfig")


def _refuse(what: str, original=None):
    def refuse(*args, **kwargs):
        command = args[1] if len(args) > 1 else kwargs.get("args")
        if original is not None and isinstance(command, (list, tuple)) and command \
                and os.path.basename(str(command[0])) in PROBES:
            return original(*args, **kwargs)
        raise AssertionError(
            f"a unit test started a process ({what} {args[1:2] or ''}); tests under tests/unit start none: "
            "move the test to tests/integration/ (and mark it slow)"
        )
    return refuse


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every test here, slow ones too (a long in-process fuzz run is still a unit test; a process is not).
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess", subprocess.Popen._execute_child))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing"))
    monkeypatch.setattr(os, "fork", _refuse("os.fork"))
    # Pictures stay .dot sources here (graphviz's `dot` is a process; rendering is
    # tests/integration/test_graph_render.py's): the graph module alone sees no `dot` on the PATH.
    monkeypatch.setattr(render, "shutil", SimpleNamespace(**{**vars(shutil), "which": lambda name, *a, **k: None}))
