"""Jobs of several stages per rank for the precision tests (interleaved, zbinterleaved, zbv): the worker's flags for
one job of a `--jobs` world, and the single-process oracle over the plan the workers ran."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from model_parallel.codegen.naming import state_key
from model_parallel.graph.plan import Plan, write_plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.trainer import SingleProcessRunner


def job_argv(job: dict, root: Path, steps: int, schedule: str, ranks: Callable[[dict, int], list[int]]) -> list[str]:
    """The worker's flags for `job` (keys: name, model, world, stages, bf16, recompute, adamw, replicas, extra);
    a replicated job gets a plan file placing replica i of stage k on `ranks(job, k)[i]`."""
    argv = ["--model", job["model"], "--schedule", schedule, "--steps", str(steps), "--timeout", "60",
            "--num_stages", str(job["stages"]), "--num_microbatches", str(job["world"]),
            "--batch_size", str(2 * job["world"]), "--checkpoint_dir", str(root / job["name"])]
    argv += ["--bf16"] if job["bf16"] else []
    argv += ["--recompute", "all"] if job["recompute"] else []
    argv += ["--optimizer", "adamw", "--lr", "0.003"] if job["adamw"] else []
    argv += job["extra"]
    if job["replicas"] > 1:  # a plan file: the default split has one replica per stage
        r = recipe(job["model"])
        graph, _ = trace_model(r.model(0), r.example(2))
        plan = even_plan(graph, job["stages"])
        plan = replace(plan, stages=tuple(replace(s, ranks=tuple(ranks(job, s.stage_id)), num_replicas=job["replicas"])
                                          for s in plan.stages))
        write_plan(plan, root / f"{job['name']}.plan.json")
        argv[argv.index("--num_stages"):argv.index("--num_stages") + 2] = ["--plan", str(root / f"{job['name']}.plan.json")]
    return argv


def reference_params(job: dict, plan: Plan, steps: int) -> dict[str, torch.Tensor]:
    """The same stages (`plan`, the one the workers ran: bf16 rounds at its cuts) in one process, microbatch by
    microbatch (the schedule's order does not change the math with a flush)."""
    r = recipe(job["model"])
    model = r.model(0)
    graph, _ = trace_model(model, r.example(2))
    batch = 2 * job["world"]
    if job["adamw"]:
        factory = lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.0)  # noqa: E731
    else:
        factory = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    config = TrainConfig(batch_size=batch, num_microbatches=job["world"], bf16=job["bf16"],
                         recompute=True if job["recompute"] else False)
    runner = SingleProcessRunner(graph, plan, model, r.criterion, factory, r.data(batch, 0), config)
    runner.train(steps)
    return {state_key(k): v.detach() for k, v in model.named_parameters()}  # the stages share its layers
