"""A worker that runs out of memory while training exits 5 (its own failure, docs/reliability.md), not 2.

`OutOfMemoryError` is a `ModelParallelError`, and the worker's handler for those (configuration errors) exited 2, "a
usage or configuration error", against the exit-code table (cli/worker_exit.py) that lists out of memory under 5."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import launch, worker_commands
from support.mlp import mlp_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Rank 1's training is refused an allocation as torch's CPU allocator refuses one under RLIMIT_DATA (a real cap makes
# the first refusal land anywhere, a thread's stack included: an abort, not this path).
_CAPPED = r'''
import runpy, sys
from model_parallel.runtime.step import loop


def refused(*args, **kwargs):
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 25165824 bytes. Error code 12 (Cannot allocate memory)")


loop.run_loop = refused
sys.argv = ["model_parallel.cli.worker", *sys.argv[1:]]
runpy.run_module("model_parallel.cli.worker", run_name="__main__")
'''


def test_a_worker_out_of_memory_exits_5_and_its_peer_names_it(tmp_path: Path) -> None:
    graph_path, plan_path = mlp_job(tmp_path, 2)
    wrapper = tmp_path / "capped.py"
    wrapper.write_text(_CAPPED)
    commands = worker_commands(["--graph", str(graph_path), "--plan", str(plan_path), "--steps", "2", "--batch_size", "8",
                                "--num_microbatches", "4", "--optimizer", "adamw", "--timeout", "30"], 2)
    commands[1] = [sys.executable, str(wrapper), *commands[1][3:]]  # `python -m model_parallel.cli.worker` -> wrapper
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    result = launch(commands, timeout=180, env=env)
    assert not result.timed_out, result.summary()
    assert "ran out of memory" in result.output(1), result.summary()
    assert result.workers[1].returncode == 5, result.summary()
    assert result.workers[0].returncode == 3 and "rank 1 failed" in result.output(0), result.summary()
