"""The built-in MLP job run by worker processes under a coordinator with `--recover` (the recovery, migration and
join tests share it): its graph and even plan, the workers' flags and polling the coordinator's status."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from model_parallel.coordinator.local import CoordinatorProcess
from model_parallel.errors import ModelParallelError
from model_parallel.graph.io import save_graph
from model_parallel.graph.plan import write_plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.launch import LocalWorld

TOKEN = "recovery-coordinator-token"


def write_job(directory: Path, num_stages: int) -> tuple[Path, Path]:
    """graph.json of the built-in MLP as the workers trace it, and its even plan for `num_stages` ranks."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    save_graph(graph, directory / "graph.json")
    write_plan(even_plan(graph, num_stages), directory / f"plan{num_stages}.json")
    return directory / "graph.json", directory / f"plan{num_stages}.json"


def worker_args(plan: Path, steps: int, checkpoints: Path, address: str, *extra: str) -> list[str]:
    """Rank 0 slowed 40x (timing only) so an operator's request lands while the job runs."""
    return ["--model", "mlp", "--plan", str(plan), "--steps", str(steps), "--batch_size", "8", "--num_microbatches", "4",
            "--lr", "0.01", "--checkpoint_dir", str(checkpoints), "--checkpoint_every", "2", "--timeout", "5",
            "--coordinator", address, "--token", TOKEN, "--slowdown", "40", "--slowdown_rank", "0", *extra]


def poll(coord: CoordinatorProcess, world: LocalWorld, until: Callable[[dict[str, Any]], bool],
         timeout: float = 120.0) -> dict[str, Any]:
    """The coordinator's status once `until(status)` holds (the workers still running), else fail naming the last."""
    deadline, status = time.monotonic() + timeout, {}
    while time.monotonic() < deadline and any(p.poll() is None for p in world.procs):
        try:
            status = coord.ctl("status")
        except Exception:  # noqa: BLE001 - not listening yet (a coordinator being started again)
            status = {}
        if status and until(status):
            return status
        time.sleep(0.25)
    workers = "\n".join("\n".join(world.lines(r)[-15:]) for r in range(len(world.procs)))
    raise AssertionError(f"the coordinator's status never got there: {json.dumps(status)[:1500]}\n{coord.output()[-2000:]}"
                         f"\nworkers:\n{workers}")


def release(coord: CoordinatorProcess, world: LocalWorld, timeout: float = 30.0) -> None:
    """Lift rank 0's slowdown (`ctl slow --factor 1`) once the test has seen what it waited for: the job's remaining
    steps run at full speed (the slowdown is timing only, so the parameters are the same). Without it each of these
    jobs spent most of its minute slowed after the last event. Asked again while the coordinator cannot reach rank 0
    (a connection being re-made); nothing to do once the job has ended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            coord.ctl("slow", rank=0, factor=1.0)
            return
        except ModelParallelError:
            if not any(p.poll() is None for p in world.procs):
                return
            if time.monotonic() > deadline:
                raise
        time.sleep(0.25)
