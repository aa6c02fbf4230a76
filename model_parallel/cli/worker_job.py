"""The worker's flags as typed inputs: the job they describe (a `JobSpec` for `api.job.build_job`, with what
`--schedule auto` may not pick and why), the `TrainConfig` and `RunOptions`, and the optimizer factory.

`cli/worker.py` parses the flags and runs what these build; tests build jobs and configs from flags here too.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from model_parallel.api.job import JobSpec, build_job
from model_parallel.cli import data_flags
from model_parallel.cli.served_job import ServedJob
from model_parallel.errors import PlanError
from model_parallel.optimizer.memory import optimizer_kind
from model_parallel.runtime.run import Job


def job_spec(args: Any, served: Optional[ServedJob] = None, device: Optional[torch.device] = None) -> JobSpec:
    """The job the flags describe (`--model/--package/--graph`, the plan and the data), or the coordinator sent."""
    from model_parallel.graph.plan import parse_stage_to_num_ranks

    refusals = schedule_refusals(args, device)
    if served is not None:
        return JobSpec(graph=served.graph, plan=args.plan or served.plan, loss=args.loss, num_classes=args.num_classes,
                       data=args.data, seed=args.seed, batch_size=args.batch_size, num_microbatches=args.num_microbatches,
                       weights=args.weights, schedule=args.schedule, schedule_refusals=refusals,
                       schedule_order=args.schedule_order, **data_flags.spec_fields(args))
    sources = [s for s in ("model", "package", "graph") if getattr(args, s)]
    if len(sources) != 1:
        raise PlanError(f"give exactly one of --model, --package, --graph (got {', '.join('--' + s for s in sources) or 'none'})")
    replicas = parse_stage_to_num_ranks(args.stage_to_num_ranks) if args.stage_to_num_ranks else None
    return JobSpec(model=args.model or None, package=args.package or None, graph=args.graph or None,
                   plan=args.plan or None, num_stages=args.num_stages, stage_to_num_ranks=replicas, loss=args.loss,
                   input_shape=parse_shape(args.input_shape), num_classes=args.num_classes, data=args.data,
                   seed=args.seed, batch_size=args.batch_size, num_microbatches=args.num_microbatches,
                   weights=args.weights, memory_per_worker=args.memory_per_worker, schedule=args.schedule,
                   schedule_refusals=refusals, schedule_order=args.schedule_order,
                   optimizer=optimizer_kind(args.optimizer, args.momentum),
                   offload_chunk=args.offload_chunk_mb * 1e6 if args.offload_optimizer else None,
                   **data_flags.spec_fields(args))


def schedule_refusals(args: Any, device: Optional[torch.device] = None) -> dict[str, str]:
    """What `--schedule auto` may not pick with these flags on this `device` (CUDA: NCCL), and why."""
    from model_parallel.api.auto_schedule import schedule_refusals as config_refusals

    config, _ = make_config(args)
    return config_refusals(config, bool(args.measure_memory), "nccl" if device is not None and device.type == "cuda" else "gloo")


def load_job(args: Any, world_size: int, served: Optional[ServedJob] = None, device: Optional[torch.device] = None) -> Job:
    """Graph, plan, seed-built model, criterion and dataset from the command line (or the coordinator); `device`:
    where the world trains (what `--schedule auto` may pick depends on it)."""
    return build_job(job_spec(args, served, device), world_size)


def parse_shape(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """`--input_shape 3,224,224` -> (3, 224, 224) (per sample, without the batch dimension)."""
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise PlanError(f"--input_shape: {text!r} is not a comma-separated list of positive sizes, e.g. 3,224,224")
    return shape


def make_config(args: Any) -> Any:
    """The training hyperparameters and the run options the arguments give: (TrainConfig, RunOptions)."""
    from model_parallel.errors import ConfigError
    from model_parallel.runtime.config import RunOptions, StragglerInjection, TrainConfig

    config = TrainConfig(
        batch_size=args.batch_size, num_microbatches=args.num_microbatches, schedule=args.schedule, seed=args.seed,
        recompute=parse_recompute(args.recompute), bf16=args.bf16, clip_grad=args.clip_grad, lr_schedule=args.lr_schedule,
        schedule_order=args.schedule_order,
    )
    if args.slowdown != 1.0 and args.slowdown_rank is None:
        raise ConfigError(f"--slowdown {args.slowdown} needs --slowdown_rank R (the rank to slow down)")
    straggler = None
    if args.slowdown_rank is not None:
        straggler = StragglerInjection(args.slowdown, args.slowdown_rank, args.slowdown_after_step)
    options = RunOptions(
        timeout=args.timeout, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume, trace_dir=args.trace_dir, metrics=args.metrics,
        straggler=straggler, measure_memory=args.measure_memory, allow_config_change=args.allow_config_change,
        eval_every=args.eval_every, eval_steps=args.eval_steps, offload_optimizer=args.offload_optimizer,
        offload_chunk_mb=args.offload_chunk_mb, gloo_loop_nice=args.gloo_loop_nice,
    )
    return config, options


def parse_recompute(text: Optional[str]) -> Any:
    if not text:
        return False
    if text == "all":
        return True
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise PlanError(f"--recompute {text!r}: expected 'all' or stage ids like 0,2") from None


def make_optimizer_factory(args: Any) -> Any:
    def factory(params: list) -> torch.optim.Optimizer:
        groups: Any = list(params)
        if getattr(args, "no_decay_vectors", False):
            # By what a parameter is, not its name (a stage holds tensors; the same rule on every rank and plan).
            split: list[dict[str, Any]] = [{"params": [p for p in groups if p.ndim >= 2]},
                     {"params": [p for p in groups if p.ndim < 2], "weight_decay": 0.0}]
            groups = [group for group in split if group["params"]] or groups
        if args.optimizer == "adamw":
            return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay, eps=args.eps)
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    return factory
