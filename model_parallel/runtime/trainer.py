"""The Python API: `PipelineTrainer(model, optimizer_factory, dataset, TrainConfig(...)).train(steps)`.

    import torch, torch.distributed as dist
    from model_parallel import PipelineTrainer, TrainConfig
    torch.manual_seed(0)                                   # every rank builds the same weights
    model = MyModel()
    trainer = PipelineTrainer(model, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                              dataset, TrainConfig(batch_size=32, num_microbatches=4), num_stages=2)
    trainer.train(100)
    trainer.close()                                        # or `with PipelineTrainer(...) as trainer:`

Run it under `torchrun --nproc_per_node=2 my_script.py` (one stage per rank), or without a process
group for single-process mode (all stages in this process, for debugging). `dataset` is anything
with `batch(step) -> (inputs_tuple, target)` (see `runtime.data`). Also: `single_process_reference`,
the oracle every pipeline run is compared with (the original model, same microbatching).
"""
from __future__ import annotations

import atexit
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.errors import ModelParallelError
from model_parallel.graph.core import Graph
from model_parallel.graph.loader import allow_model
from model_parallel.graph.plan import Plan
from model_parallel.runtime.data import split_microbatches
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.engine import OptimizerFactory, StepResult
from model_parallel.runtime.output import model_output
from model_parallel.runtime.update import apply_update, squared_grad_norm

logger = logging.getLogger(__name__)

__all__ = ["PipelineTrainer", "TrainConfig", "RunOptions", "SingleProcessRunner", "single_process_reference"]


def single_process_reference(
    model: nn.Module, criterion: Callable[[Any, torch.Tensor], torch.Tensor], optimizer_factory: OptimizerFactory,
    dataset: Any, config: TrainConfig, steps: int, start_step: int = 0,
) -> list[float]:
    """Train the original model the way the pipeline does: per microbatch forward/backward of loss/m,
    then clip and step. Returns the loss per step. (The oracle of the exactness tests.)"""
    optimizer = optimizer_factory(list(model.parameters()))
    losses = []
    model.train()
    for step in range(start_step, steps):
        inputs, target = dataset.batch(step)
        total = 0.0
        for mb_inputs, mb_target in split_microbatches(list(inputs), target, config.num_microbatches):
            loss = criterion(model(*mb_inputs), mb_target) / config.num_microbatches
            loss.backward()
            total += float(loss.detach())
        apply_update(optimizer, step, lr_schedule=config.lr_schedule, clip_grad=config.clip_grad)
        losses.append(total)
    return losses


class SingleProcessRunner:
    """Every stage of a plan in this process, run microbatch by microbatch (debugging mode)."""

    def __init__(self, graph: Graph, plan: Plan, model: nn.Module, criterion: Callable, optimizer_factory: OptimizerFactory,
                 dataset: Any, config: TrainConfig) -> None:
        from model_parallel.codegen.build import build_stages
        from model_parallel.runtime.stages import layer_modules

        self.graph, self.plan, self.criterion, self.dataset, self.config = graph, plan, criterion, dataset, config
        from model_parallel.runtime.tied import check_schedule

        check_schedule(graph, plan, config.schedule)  # one optimizer per stage would step a split tie twice
        self.stages = build_stages(graph, plan, modules=layer_modules(graph, model))
        # A tie split across stages is one Parameter in both here: once in the optimizer and the norm.
        self.params = list({id(p): p for s in self.stages for p in s.parameters()}.values())
        self.optimizer = optimizer_factory(self.params)
        if config.schedule == "pipedream":
            # Every stage updates on its own after each microbatch: one optimizer per stage.
            self.stage_optimizers = [optimizer_factory(list(s.parameters())) if list(s.parameters()) else None
                                     for s in self.stages]

    def _model_output(self, outputs: Sequence[Any]) -> Any:
        return model_output(self.graph, self.stages[-1].output_names, outputs)

    def _pipedream_step(self, step: int) -> StepResult:
        """PipeDream's asynchronous 1F1B with weight stashing, run in grid order in this process."""
        from torch.func import functional_call

        from model_parallel.runtime.schedule import pipedream_async

        cfg, p = self.config, len(self.stages)
        inputs, target = self.dataset.batch(step)
        microbatches = split_microbatches(list(inputs), target, cfg.num_microbatches)
        schedule = pipedream_async(p, cfg.num_microbatches)
        state: dict[tuple[int, int], dict[str, Any]] = {}
        total = 0.0
        for t in range(schedule.num_steps):
            for s in range(p):
                action = schedule.grid[s][t]
                if action is None:
                    continue
                j, stage = action.microbatch, self.stages[s]
                if action.is_forward:
                    if s == 0:
                        values = list(microbatches[j][0])
                    else:
                        values = [v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) and v.is_floating_point()
                                  else v for v in state[(s - 1, j)]["outputs"]]
                    weights = {n: q.detach().clone().requires_grad_(True) for n, q in stage.named_parameters()}
                    outputs = functional_call(stage, weights, tuple(values))
                    entry = {"inputs": values, "outputs": outputs, "weights": weights}
                    if s == p - 1:
                        entry["loss"] = self.criterion(self._model_output(list(outputs)), microbatches[j][1])
                        total += float(entry["loss"].detach()) / cfg.num_microbatches
                    state[(s, j)] = entry
                else:
                    entry = state[(s, j)]
                    if s == p - 1:
                        entry["loss"].backward()
                    else:
                        downstream = state[(s + 1, j)]["inputs"]
                        pairs = [(o, v.grad) for o, v in zip(entry["outputs"], downstream)
                                 if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(v, torch.Tensor) and v.grad is not None]
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    optimizer = self.stage_optimizers[s]
                    if optimizer is not None:
                        for n, q in stage.named_parameters():
                            q.grad = entry["weights"][n].grad
                        apply_update(optimizer, step, lr_schedule=cfg.lr_schedule)
        return StepResult(step, total, 0.0, self.stage_optimizers[0].param_groups[0]["lr"] if self.stage_optimizers[0] else 0.0)

    def train_step(self, step: int) -> StepResult:
        cfg = self.config
        if cfg.schedule == "pipedream":
            return self._pipedream_step(step)
        inputs, target = self.dataset.batch(step)
        total = 0.0
        for j, (mb_inputs, mb_target) in enumerate(split_microbatches(list(inputs), target, cfg.num_microbatches)):
            values: list[Any] = list(mb_inputs)
            for index, stage in enumerate(self.stages):
                with torch.autocast("cpu", dtype=torch.bfloat16) if cfg.bf16 else torch.autocast("cpu", enabled=False):
                    if cfg.recompute_stage(index):
                        from torch.utils.checkpoint import checkpoint

                        values = list(checkpoint(stage, *values, use_reentrant=False))
                    else:
                        values = list(stage(*values))
            loss = self.criterion(self._model_output(values).float(), mb_target) / cfg.num_microbatches
            loss.backward()
            total += float(loss.detach())
        norm = squared_grad_norm(self.params) ** 0.5
        lr = apply_update(self.optimizer, step, lr_schedule=cfg.lr_schedule, clip_grad=cfg.clip_grad, total_norm=norm)
        return StepResult(step, total, norm, lr)

    def train(self, steps: int, start_step: int = 0) -> list[StepResult]:
        return [self.train_step(step) for step in range(start_step, steps)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's state by stage-module name (`layer1_0_conv1.weight`)."""
        return {k: v for s in self.stages for k, v in s.state_dict().items()}


class PipelineTrainer:
    """Pipeline-train a model (or a graph, or a generated package directory) on the current
    process group, or in this process when no group is initialised (or `single_process=True`)."""

    def __init__(
        self,
        model_or_package_or_graph: Union[nn.Module, Graph, str, Path],
        optimizer_factory: OptimizerFactory,
        dataset: Any,
        config: TrainConfig = TrainConfig(),
        *,
        options: RunOptions = RunOptions(),
        criterion: Callable[[Any, torch.Tensor], torch.Tensor] = F.cross_entropy,
        plan: Optional[Plan] = None,
        num_stages: Optional[int] = None,
        example_inputs: Optional[Sequence[Any]] = None,
        channel: Any = None,
        single_process: Optional[bool] = None,
    ) -> None:
        import torch.distributed as dist

        from model_parallel.runtime.stages import even_plan

        source = model_or_package_or_graph
        if isinstance(source, (str, Path)):
            from model_parallel.graph.io import load_graph
            from model_parallel.graph.plan import read_plan

            graph = load_graph(Path(source) / "graph.json")
            plan = plan or read_plan(Path(source) / "plan.json")
            source = graph
        if isinstance(source, Graph):
            from model_parallel.codegen.build import full_model_from_graph

            torch.manual_seed(config.seed)
            graph, model = source, full_model_from_graph(source)
        elif isinstance(source, nn.Module):
            from model_parallel.profiler.trace import trace_model

            model = source
            if example_inputs is None:
                inputs, _ = dataset.batch(0)
                example_inputs = [x[: max(1, config.batch_size // config.num_microbatches)] for x in inputs]
            graph, traced = trace_model(model, tuple(example_inputs))
            allow_model(model, traced)  # the graph comes from this process's own model, not from a file
        else:
            raise ModelParallelError(f"PipelineTrainer takes an nn.Module, a Graph or a package directory, "
                                     f"got {type(source).__name__}")
        distributed = dist.is_available() and dist.is_initialized()
        self.single_process = (not distributed) if single_process is None else single_process
        world = dist.get_world_size() if distributed and not self.single_process else 1
        if plan is None:
            plan = even_plan(graph, num_stages or (world if not self.single_process else 2))
        if world > 1:
            # Ranks may have profiled and partitioned on their own (timings differ per process):
            # everyone trains rank 0's plan, or stages would not line up.
            from model_parallel.runtime.comm import broadcast_json

            text = broadcast_json(json.dumps(plan.to_dict()), 0, None, options.timeout)
            plan = Plan.from_dict(json.loads(text), "the plan broadcast by rank 0")
        self.graph, self.plan, self.model = graph, plan.with_default_ranks(), model
        self.health: Any = None
        from model_parallel.runtime.tied import check_schedule

        check_schedule(graph, self.plan, config.schedule)  # before any runner or heartbeat starts
        if self.single_process:
            self.runner: Any = SingleProcessRunner(graph, self.plan, model, criterion, optimizer_factory, dataset, config)
        else:
            from model_parallel.runtime.engine import PipelineEngine
            from model_parallel.runtime.health import Health

            # Heartbeats in the process group's own store, so a dead peer is named (see health.py).
            store = dist.distributed_c10d._get_default_store()
            device = torch.device("cpu")
            if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
                device = torch.device("cuda", torch.cuda.current_device())
                model.to(device)
            self.health = Health(store, dist.get_rank(), dist.get_world_size(), interval=min(1.0, options.timeout / 10),
                                 store_host=None).start()
            # The heartbeat thread must be stopped before interpreter teardown: a store call still
            # running in it then aborts the process ("terminate called without an active exception").
            # atexit runs before the teardown (stop() is idempotent: close() may have run already).
            atexit.register(self.health.stop, "done")
            self.runner = PipelineEngine(graph=graph, plan=self.plan, model=model, criterion=criterion,
                                         optimizer_factory=optimizer_factory, dataset=dataset, config=config, channel=channel,
                                         options=options, health=self.health, device=device)

    def train(self, steps: int) -> list[StepResult]:
        """Train `steps` steps (all ranks call this together); returns this rank's per-step results."""
        results = self.runner.train(steps)
        return results

    def close(self) -> None:
        """Stop and join the heartbeat thread (idempotent; also runs at exit). Call it before
        `dist.destroy_process_group()`: the thread writes to the group's store."""
        if self.health is not None:
            self.health.stop("done")

    def __enter__(self) -> "PipelineTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's stage state (all stages in single-process mode) by stage-module name."""
        if self.single_process:
            return self.runner.state_dict()
        return self.runner.named_state()
