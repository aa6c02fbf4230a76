"""Every stage of a plan in one process: `SingleProcessRunner` (debugging mode) and `single_process_reference`,
the oracle every pipeline run is compared with (the original model, same microbatching).

The Python API `PipelineTrainer` lives in `model_parallel.api.trainer` (it runs these in single-process mode).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Optional, TypedDict

import torch
from torch import nn
from torch.utils._pytree import tree_map

from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.batches import minibatch_parts as _microbatches, stage_zero_inputs
from model_parallel.runtime.engine import OptimizerFactory
from model_parallel.runtime.step.loop import StepResult
from model_parallel.runtime.step.output import float_output, model_output
from model_parallel.runtime.step.rng import seeded_forward
from model_parallel.runtime.step.update import apply_update, build_optimizer, squared_grad_norm
from model_parallel.runtime.wire.structure import Structure, cross, flatten_values, narrowed, unflatten

logger = logging.getLogger(__name__)

__all__ = ["SingleProcessRunner", "single_process_reference"]


class _Pass(TypedDict, total=False):
    """One (stage, microbatch) forward of the PipeDream-async reference, kept for its backward."""

    inputs: list[Any]  # the stage's leaf inputs (their .grad is what flows upstream)
    outputs: list[Any]
    weights: dict[str, torch.Tensor]  # the weight version this forward used
    leaves: list[torch.Tensor]  # not on the last stage: the flat outputs sent downstream
    tree: Structure
    loss: torch.Tensor  # the last stage only


def single_process_reference(
    model: nn.Module, criterion: Callable[[Any, torch.Tensor], torch.Tensor], optimizer_factory: OptimizerFactory,
    dataset: Any, config: TrainConfig, steps: int, start_step: int = 0,
) -> list[float]:
    """Train the original model the way the pipeline does: per microbatch forward/backward of loss/m,
    then clip and step. Returns the loss per step. (The oracle of the exactness tests.) A dataset whose
    inputs are a dict (`{"input_ids": ...}`) calls the model with keywords."""
    optimizer = optimizer_factory(list(model.parameters()))
    losses = []
    model.train()
    for step in range(start_step, steps):
        inputs, target = dataset.batch(step)
        total = 0.0
        for mb_inputs, mb_target in _microbatches(inputs, target, config.num_microbatches, f"minibatch {step}"):
            output = model(**mb_inputs[0]) if isinstance(inputs, Mapping) else model(*mb_inputs)
            loss = criterion(output, mb_target) / config.num_microbatches
            loss.backward()
            total += float(loss.detach())
        apply_update(optimizer, step, lr_schedule=config.lr_schedule, clip_grad=config.clip_grad)
        losses.append(total)
    return losses


def _stage_inputs(graph: Graph, inputs: Any, mb_inputs: Sequence[Any]) -> list[Any]:
    return stage_zero_inputs(graph.metadata.get("inputs") or (), inputs, mb_inputs)


class SingleProcessRunner:
    """Every stage of a plan in this process, run microbatch by microbatch (debugging mode). Values pass
    between stages as they would cross a pipeline boundary (`structure.cross`: flattened and rebuilt),
    so a plan runs here exactly when it runs on several ranks."""

    def __init__(self, graph: Graph, plan: Plan, model: nn.Module, criterion: Callable, optimizer_factory: OptimizerFactory,
                 dataset: Any, config: TrainConfig, initializer: Any = None, offload: Optional[tuple[str, int]] = None) -> None:
        from model_parallel.codegen.build import build_stages
        from model_parallel.runtime.build.materialize import Initializer, materialize_model
        from model_parallel.runtime.build.stages import layer_modules

        init = initializer or Initializer(seed=config.seed)  # a model on meta gets the pipeline's values
        # Stages run where the model is (a model on a GPU trains there; one on meta is made on the CPU).
        self.device = next((t.device for t in [*model.parameters(), *model.buffers()] if not t.is_meta),
                           torch.device("cpu"))
        materialize_model(model, init.seed, graph, init_weights=init.init_weights, source=init.source,
                          device=self.device)

        self.graph, self.plan, self.criterion, self.dataset, self.config = graph, plan, criterion, dataset, config
        from model_parallel.runtime.build.tied import check_schedule

        check_schedule(graph, plan, config.schedule)  # one optimizer per stage would step a split tie twice
        self.stages = build_stages(graph, plan, modules=layer_modules(graph, model))
        # A tie split across stages is one Parameter in both here: once in the optimizer and the norm.
        named = list({id(p): (f"stage{k}.{n}", p) for k, s in enumerate(self.stages) for n, p in s.named_parameters()}.values())
        self.params = [p for _, p in named]
        self.optimizer = build_optimizer(optimizer_factory, named)
        if config.schedule == "pipedream":
            # Every stage updates on its own after each microbatch: one optimizer per stage.
            self.stage_optimizers = [build_optimizer(optimizer_factory, list(s.named_parameters()))
                                     if list(s.parameters()) else None for s in self.stages]
        if offload is not None:  # (directory, chunk bytes): the optimizers' state in files (runtime/step/offload.py)
            from model_parallel.runtime.step.offload import attach

            for optimizer in [self.optimizer, *getattr(self, "stage_optimizers", [])]:
                if optimizer is not None:
                    attach(optimizer, offload[0], offload[1])

    def _batch(self, step: int) -> tuple[Any, Any]:
        """Minibatch `step`, on the stages' device."""
        batch = self.dataset.batch(step)
        if self.device.type == "cpu":
            return batch
        return tree_map(lambda v: v.to(self.device) if isinstance(v, torch.Tensor) else v, batch)

    def _model_output(self, outputs: Sequence[Any]) -> Any:
        return model_output(self.graph, self.stages[-1].output_names, outputs)

    def _names(self, stage: Any) -> tuple[str, ...]:
        return tuple(stage.output_names)

    def _pipedream_step(self, step: int) -> StepResult:
        """PipeDream's asynchronous 1F1B with weight stashing, run in grid order in this process. Under
        bf16 as the pipeline runs it: forwards under autocast, float32 boundary values and their
        gradients rounded to bf16 at the cuts (`wire`), the loss on the float32 output."""
        from torch.func import functional_call

        from model_parallel.runtime.step.schedule import pipedream_async

        cfg, p = self.config, len(self.stages)
        wire = cfg.wire_dtype

        def rounded(value: Any) -> Any:  # what arrives over the wire: narrowed and widened back
            return value.to(wire).to(value.dtype) if isinstance(value, torch.Tensor) and narrowed(value, wire) else value

        inputs, target = self._batch(step)
        microbatches = _microbatches(inputs, target, cfg.num_microbatches, f"minibatch {step}")
        schedule = pipedream_async(p, cfg.num_microbatches)
        state: dict[tuple[int, int], _Pass] = {}
        total = 0.0
        for t in range(schedule.num_steps):
            for s in range(p):
                action = schedule.grid[s][t]
                if action is None:
                    continue
                j, stage = action.microbatch, self.stages[s]
                if action.is_forward:
                    if s == 0:
                        leaves = values = _stage_inputs(self.graph, inputs, microbatches[j][0])
                    else:
                        # A new graph per stage, as across ranks: the boundary's flat tensors, detached.
                        upstream = state[(s - 1, j)]
                        leaves = [rounded(v.detach()).requires_grad_(v.requires_grad) if v.is_floating_point() else v
                                  for v in upstream["leaves"]]
                        values = unflatten(leaves, upstream["tree"])
                    weights = {n: q.detach().clone().requires_grad_(True) for n, q in stage.named_parameters()}
                    with torch.autocast("cpu", dtype=torch.bfloat16) if cfg.bf16 else torch.autocast("cpu", enabled=False), \
                            seeded_forward(self.device, cfg.seed, step, s, j):
                        outputs = list(functional_call(stage, weights, tuple(values)))
                    entry: _Pass = {"inputs": leaves, "outputs": outputs, "weights": weights}
                    if s < p - 1:
                        entry["leaves"], entry["tree"] = flatten_values(outputs, self._names(stage))
                    else:
                        output = self._model_output(outputs)
                        entry["loss"] = self.criterion(float_output(output) if cfg.bf16 else output, microbatches[j][1])
                        total += float(entry["loss"].detach()) / cfg.num_microbatches
                    state[(s, j)] = entry
                else:
                    entry = state[(s, j)]
                    if s == p - 1:
                        entry["loss"].backward()
                    else:
                        downstream = state[(s + 1, j)]["inputs"]
                        pairs = [(o, rounded(v.grad).to(o.dtype)) for o, v in zip(entry["leaves"], downstream, strict=True)
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
        inputs, target = self._batch(step)
        total = 0.0
        for j, (mb_inputs, mb_target) in enumerate(_microbatches(inputs, target, cfg.num_microbatches, f"minibatch {step}")):
            loss = self.criterion(self._forward(inputs, mb_inputs, recompute=True, key=(step, j)), mb_target) / cfg.num_microbatches
            loss.backward()
            total += float(loss.detach())
        norm = squared_grad_norm(self.params) ** 0.5
        lr = apply_update(self.optimizer, step, lr_schedule=cfg.lr_schedule, clip_grad=cfg.clip_grad, total_norm=norm)
        return StepResult(step, total, norm, lr)

    def _forward(self, inputs: Any, mb_inputs: Sequence[Any], recompute: bool, key: Optional[tuple[int, int]] = None) -> Any:
        """One microbatch through every stage, values crossing each cut as on the wire; the float model output.
        `key`: (step, microbatch), the random masks' key as the pipeline draws them (step/rng.py); None in eval."""
        cfg = self.config
        values: list[Any] = _stage_inputs(self.graph, inputs, mb_inputs)
        for index, stage in enumerate(self.stages):
            if index > 0:
                values = cross(values, self._names(self.stages[index - 1]), cfg.wire_dtype)
            seeded = seeded_forward(self.device, cfg.seed, key[0], index, key[1]) if key is not None else nullcontext()
            with torch.autocast("cpu", dtype=torch.bfloat16) if cfg.bf16 else torch.autocast("cpu", enabled=False), seeded:
                if recompute and cfg.recompute_stage(index):
                    from torch.utils.checkpoint import checkpoint

                    values = list(checkpoint(stage, *values, use_reentrant=False))
                else:
                    values = list(stage(*values))
        return float_output(self._model_output(values))

    def train(self, steps: int, start_step: int = 0) -> list[StepResult]:
        return [self.train_step(step) for step in range(start_step, steps)]

    def evaluate(self, dataset: Any, steps: int, metric: Any = None) -> Any:
        """Forward-only over `steps` minibatches of `dataset`, stages in eval mode: `evaluate.EvalResult`."""
        from model_parallel.runtime.step.evaluate import check_deterministic, evaluate_in_process

        check_deterministic(self.graph)
        return evaluate_in_process(list(self.stages), lambda inputs, mb: self._forward(inputs, mb, recompute=False),
                                   self.criterion, dataset, self.config.num_microbatches, steps, metric)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's state by stage-module name (`layer1_0_conv1.weight`)."""
        return {k: v for s in self.stages for k, v in s.state_dict().items()}

