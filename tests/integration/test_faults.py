"""Faults and wrong configurations, with the seed's command lines: every process ends within its timeout
with a message naming the rank, the last checkpoint stays intact and resumes to the single-process result.

(kill -9 of a worker *with* a coordinator, and resuming on fewer workers, is in test_rebalance.py; SIGSTOP of a
worker or of the coordinator, kill -9 of rank 0, a dropped control connection and exit codes in test_liveness.py.)
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO

from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.runtime.checkpoint.store import latest_step, load_checkpoint
from model_parallel.runtime.launch import LocalWorld, free_port, launch_workers, worker_commands
from support.mlp import assert_params_close, mlp_job, reference_params

WORKER = ("-m", "model_parallel.cli.worker")  # run from REPO (cwd below), as the launchers do
PYTHON = sys.executable
TOKEN = "faults-test-token"
PEER_TIMEOUT = 10  # --timeout of every worker: how long a blocking call may wait for a peer
EXIT_PEER = 3  # a worker's exit code when a peer died, stalled or never joined
EXIT_STOPPED = 4  # ... when the run was stopped before its requested steps
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def args(plan: Path, steps: int, checkpoints: Path, *extra: object) -> list[str]:
    return ["--model", "mlp", "--plan", str(plan), "--steps", str(steps), "--batch_size", "8", "--num_microbatches", "4",
            "--lr", "0.01", "--checkpoint_dir", str(checkpoints), "--timeout", str(PEER_TIMEOUT), *map(str, extra)]


def resume_and_compare(plan: Path, checkpoints: Path) -> None:
    """Continue from the last checkpoint for 3 more steps; the result must equal uninterrupted training."""
    last = latest_step(checkpoints)
    assert last is not None
    load_checkpoint(checkpoints)  # intact: manifest, every shard, fingerprints
    total = last + 4  # steps 0..last were done; run last+1..last+3
    resumed = launch_workers(args(plan, total, checkpoints, "--resume"), 2, timeout=120)
    assert resumed.ok, resumed.summary()
    assert latest_step(checkpoints) == total - 1
    assert_params_close(load_checkpoint(checkpoints).params(), reference_params(total), "resumed run")


# ---- a worker dies --------------------------------------------------------------------------------
def test_kill9_worker_mid_step_stops_the_other_and_resumes_exactly(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    with LocalWorld(worker_commands(args(plan, 100_000, checkpoints, "--checkpoint_every", 3), 2)) as world:
        world.wait_for_line(0, r"checkpoint step 2 committed", timeout=120)
        world.kill(1)  # training never pauses between steps: rank 1 dies mid-step
        result = world.wait(timeout=PEER_TIMEOUT + 40)  # timed out: the survivor did not end in time
    assert not result.timed_out, result.summary()
    survivor = result.workers[0]
    assert survivor.returncode == EXIT_PEER, result.summary()
    error_lines = [line for line in survivor.output.splitlines() if "error" in line.lower()]
    assert any("rank 1" in line for line in error_lines), f"rank 0's error must name rank 1:\n{result.summary()}"
    assert any("rank 1 stopped responding (last heartbeat" in line for line in error_lines), result.summary()
    assert "rank -1" not in survivor.output, f"a collective is not a rank:\n{result.summary()}"
    assert "Traceback" not in survivor.output, survivor.output[-3000:]
    resume_and_compare(plan, checkpoints)


@pytest.mark.parametrize("rank, sig", [(0, signal.SIGTERM), (1, signal.SIGINT)])
def test_a_stop_signal_ends_every_rank_at_one_step_with_a_checkpoint_that_resumes_exactly(tmp_path: Path, rank: int,
                                                                                         sig: int) -> None:
    """SIGTERM (preemption, torchrun stopping the job) or Ctrl-C on one rank: every rank stops after the same step,
    its checkpoint committed, and exits EXIT_STOPPED naming the signal; rank 0 posts its part of the step's
    reduction early, rank 1 (the last stage) is its root (runtime/step/stop_signals.py). It used to die mid-step:
    its peers said "stopped responding" and the steps since the last checkpoint were lost."""
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    with LocalWorld(worker_commands(args(plan, 100_000, checkpoints, "--checkpoint_every", 1000), 2)) as world:
        world.wait_for_line(0, r"step 2 loss", timeout=120)
        world.kill(rank, sig)
        result = world.wait(timeout=PEER_TIMEOUT + 40)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [EXIT_STOPPED, EXIT_STOPPED], result.summary()
    stopped = {int(re.search(r"stopped after (\d+) of the 100000 requested step", result.output(r)).group(1))
               for r in range(2)}
    assert len(stopped) == 1, result.summary()  # the same boundary on both ranks
    assert latest_step(checkpoints) == stopped.pop() - 1  # not a multiple of --checkpoint_every: the stop's own
    name = signal.Signals(sig).name
    assert f"this rank got {name}; every rank stopped at the same step boundary" in result.output(rank), result.summary()
    assert "another rank got a stop signal (SIGTERM or SIGINT)" in result.output(1 - rank), result.summary()
    assert "Traceback" not in result.output(0) + result.output(1), result.summary()
    assert "--resume" in result.output(rank)  # the command that resumes
    resume_and_compare(plan, checkpoints)


def test_worker_that_never_joins_times_out_with_a_message(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    join_timeout = 3
    only_rank0 = worker_commands(args(plan, 5, tmp_path / "ck", "--timeout", join_timeout), 2)[:1]  # last --timeout wins
    with LocalWorld(only_rank0) as world:
        result = world.wait(timeout=join_timeout + 40)
    assert not result.timed_out, result.summary()
    output = result.output(0)
    assert result.workers[0].returncode == EXIT_PEER, result.summary()
    assert f"not every one of the 2 ranks joined within {join_timeout} s" in output and "Traceback" not in output, output
    assert "rank(s) [1] never joined" in output, output


# ---- the coordinator or the control connection goes away -------------------------------------------------
def test_kill9_coordinator_training_finishes_exactly(tmp_path: Path) -> None:
    """The coordinator is an optimisation: losing it is logged by every rank and training goes on."""
    graph, plan = mlp_job(tmp_path, 2)
    steps = 120
    with CoordinatorProcess(graph, plan, TOKEN, workdir=tmp_path / "coord", extra=["--policy", "manual"]) as coord:
        commands = worker_commands(args(plan, steps, tmp_path / "ck", "--coordinator", coord.address, "--token", TOKEN), 2)
        with LocalWorld(commands) as world:
            world.wait_for_line(0, r"step 3 loss", timeout=120)
            assert coord.proc is not None
            os.killpg(coord.proc.pid, signal.SIGKILL)
            result = world.wait(timeout=120)
    assert result.ok, result.summary()
    for rank in range(2):
        assert f"rank {rank} lost the coordinator" in result.output(rank), result.summary()
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "run without its coordinator")


# A worker's control connection dropping, and the coordinator standing still, are in test_liveness.py:
# the worker reconnects and the run completes (the coordinator never stops a run).


# ---- wrong configurations: one line, exit code 2 ------------------------------------------------------------
def run_all(commands: dict[str, list[str]], timeout: float = 120) -> dict[str, subprocess.CompletedProcess]:
    """Run independent commands side by side (each is mostly `import torch`); kill any left at the deadline."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen(list(map(str, c)), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True) for name, c in commands.items()}
    results = {}
    deadline = time.monotonic() + timeout
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def one_worker(*extra: object) -> list[object]:
    """A world of one rank (no peer to wait for), so a configuration error is the only way to fail."""
    return [PYTHON, *WORKER, "--rank", 0, "--world_size", 1, "--dist_addr", "127.0.0.1", "--dist_port", free_port(),
            "--timeout", PEER_TIMEOUT, "--steps", 2, *extra]


@pytest.fixture(scope="module")
def config_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    work = tmp_path_factory.mktemp("config")
    _, plan3 = mlp_job(work, 3, name="plan3.json")
    mlp_checkpoint = work / "mlp_ck"
    made = run_all({"make": one_worker("--model", "mlp", "--checkpoint_dir", mlp_checkpoint)})["make"]
    assert made.returncode == 0, made.stderr[-3000:]
    return run_all({
        "unknown model": one_worker("--model", "nosuch"),
        "unknown arch": [PYTHON, REPO / "model_parallel/profiler/image_classification/main.py", "-a", "nosuchnet",
                         "--profile_directory", work / "profiles"],
        "bad stage_to_num_ranks": one_worker("--model", "mlp", "--stage_to_num_ranks", "0:x"),
        "stage_to_num_ranks names a missing stage": one_worker("--model", "mlp", "--stage_to_num_ranks", "0:1,5:1"),
        "plan bigger than the world": one_worker("--model", "mlp", "--plan", plan3),
        "checkpoint from another model": one_worker("--model", "gpt", "--resume", "--checkpoint_dir", mlp_checkpoint),
    })


@pytest.mark.parametrize("case, message", [
    ("unknown model", r"unknown model 'nosuch'; built-in models: gpt, mlp, resnet18"),
    ("unknown arch", r"unknown architecture 'nosuchnet'; valid ones: alexnet"),
    ("bad stage_to_num_ranks", r"--stage_to_num_ranks: '0:x' is not '<stage>:<replicas>'"),
    ("stage_to_num_ranks names a missing stage", r"--stage_to_num_ranks names stage\(s\) \[5\] but the plan has stages 0..0"),
    ("plan bigger than the world", r"the plan places stages on rank\(s\) \[1, 2\] but the world has ranks 0..0"),
    ("checkpoint from another model", r"another model"),
])
def test_wrong_configuration_is_one_clear_line(config_errors: dict, case: str, message: str) -> None:
    import re

    result = config_errors[case]
    err = result.stderr
    # Log lines (the plan table at INFO) may precede it; the error itself is exactly one line.
    errors = [line for line in err.splitlines() if "error:" in line]
    assert result.returncode == 2, f"{case}: exit {result.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and re.search(message, errors[0]), f"{case}: expected one error line matching {message!r}, got:\n{err}"
