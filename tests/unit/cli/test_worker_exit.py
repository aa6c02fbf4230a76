"""The last line after a failure names a command the user can run again: the way this worker was really launched
(`python -m`, a script, the console script; torchrun with its process count), not a `python worker.py` that is not there."""
from __future__ import annotations

import os
import sys

import pytest

from model_parallel.cli.worker_exit import launch_command, resume_hint

PY = os.path.basename(sys.executable)
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("env, module, argv0, want, note", [
    ({}, "model_parallel.cli.worker", "/x/model_parallel/cli/worker.py", [PY, "-m", "model_parallel.cli.worker"], ""),
    ({}, "", "/x/test_parallel_0.py", [PY, "test_parallel_0.py"], ""),
    ({}, "", "/venv/bin/model-parallel", ["model-parallel", "worker"], ""),
    (TORCHRUN, "model_parallel.cli.worker", "/x/worker.py",
     ["torchrun", "--nproc_per_node=2", "-m", "model_parallel.cli.worker"], ""),
    ({**TORCHRUN, "GROUP_WORLD_SIZE": "3"}, "", "test_parallel_0.py",
     ["torchrun", "--nnodes=3", "--nproc_per_node=2", "test_parallel_0.py"], " (on every node, with the same rendezvous flags)"),
])
def test_the_launch_command_is_how_the_worker_was_started(env, module, argv0, want, note):
    assert launch_command(env, module, argv0) == (want, note)


def test_the_resume_hint_adds_resume_to_the_real_command(tmp_path, monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    monkeypatch.setattr(sys, "argv", ["/x/test_parallel_0.py"])
    hint = resume_hint(str(tmp_path), ["--model", "mlp", "--checkpoint_dir", str(tmp_path)], 1)
    assert hint == (f"[rank 1] no checkpoint was committed in {tmp_path}; rerun to start over: "
                    f"{PY} test_parallel_0.py --model mlp --checkpoint_dir {tmp_path} --resume")
