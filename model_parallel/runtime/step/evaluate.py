"""Validation: a forward-only pass over a dataset (no backward, no stash, no optimizer), the mean loss and
an optional user metric, on a running pipeline and in one process (its oracle).

    result = engine.evaluate(eval_data, steps=4, metric=accuracy)   # every rank together
    result.loss, result.metric                                      # means over steps x microbatches

Per step, stage 0 reads the minibatch's inputs and the last stage its targets, each split as training
splits them (`engine.step_data`); every stage runs its forwards in microbatch order under no_grad
(executor.run_forward); the last stage sums criterion(output, target) / m
(and metric / m); one all-reduce of [loss, metric] over all ranks ends the step. Stages run in eval mode
(dropout off, BatchNorm on its running statistics: codegen/modes.py makes a trace's training-mode literals
follow the stage's mode) and go back to train mode after.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.codegen.modes import random_in_eval
from model_parallel.errors import CodegenError, ConfigError, PeerError
from model_parallel.graph.core import Graph
from model_parallel.runtime.data.batches import minibatch_parts
from model_parallel.runtime.step.executor import StepData, StepExecutor
from model_parallel.runtime.wire import comm

Metric = Callable[[Any, torch.Tensor], Any]
logger = logging.getLogger(__name__)
_warned: set[tuple[int, int]] = set()  # (id of a dataset, steps) already warned about


class EvaluatingEngine(Protocol):
    """What a pipeline validation needs of a rank's engine (`PipelineEngine` is one)."""

    graph: Graph
    stage: Optional[nn.Module]  # None on a spare
    executor: Optional[StepExecutor]  # None on a spare
    control_group: Any  # a torch.distributed process group of every rank

    @property
    def timeout(self) -> float: ...

    def step_data(self, step: int, dataset: Any = None) -> StepData: ...

    def diagnose(self, error: PeerError) -> PeerError: ...


@dataclass(frozen=True)
class EvalResult:
    """Mean loss (and metric, None without one) over `steps` minibatches, each the mean of its microbatches."""

    loss: float
    metric: Optional[float]
    steps: int


def _check_steps(steps: int, dataset: Any) -> None:
    if steps < 1:
        raise ConfigError(f"evaluation steps must be >= 1 (minibatches to validate on), got {steps}")
    # A map-style dataset (sources.MapData, or a Prefetcher over one) wraps into its next epoch past its last full
    # minibatch: evaluate(val, ceil(len / batch)) counted a reshuffled minibatch twice into a top-1 accuracy, silently.
    per_epoch, batch = getattr(dataset, "steps_per_epoch", None), getattr(dataset, "batch_size", None)
    inner = dataset
    while not hasattr(inner, "__len__") and hasattr(inner, "dataset"):  # a Prefetcher over a MapData over the samples
        inner = inner.dataset
    if not isinstance(per_epoch, int) or not isinstance(batch, int) or steps <= per_epoch or (id(dataset), steps) in _warned:
        return
    _warned.add((id(dataset), steps))
    size = len(inner) if hasattr(inner, "__len__") else per_epoch * batch
    logger.warning("evaluating %d steps of a dataset of %d samples, %d minibatch(es) of %d: steps %d.. read it again "
                   "(another shuffle), so %d sample(s) count twice or more in the mean loss and metric; give steps=%d "
                   "to read each sample once (%d left out: a batch size that divides %d reads them all)",
                   steps, size, per_epoch, batch, per_epoch, (steps - per_epoch) * batch, per_epoch,
                   size - per_epoch * batch, size)


def check_deterministic(graph: Graph) -> None:
    """Refuse to validate a graph whose stages draw random numbers in eval mode too (codegen/modes.py): every
    rank decides alike, from the graph, before any message."""
    found = random_in_eval(graph)
    if found:
        named = ", ".join(f"{node} ({op})" for node, op in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise CodegenError(f"cannot evaluate: the traced model draws random numbers whatever its mode, at {named}; "
                           "the trace recorded what forward computed in training mode, and no rule here knows what "
                           "these operators do in eval mode. Evaluate the trained model in one process instead "
                           "(trainer.save_pretrained or state_dict, then model.eval()), or build it without that "
                           "randomness (e.g. a drop rate of 0)")


def evaluate_pipeline(engine: EvaluatingEngine, dataset: Any, steps: int, metric: Optional[Metric] = None) -> EvalResult:
    """`PipelineEngine.evaluate`: every rank calls it at the same point with the same arguments."""
    _check_steps(steps, dataset)
    check_deterministic(engine.graph)
    total = torch.zeros(2, dtype=torch.float64)
    stage = engine.stage
    if stage is not None:
        stage.eval()
    try:
        for step in range(steps):
            part = (0.0, 0.0)
            if engine.executor is not None:
                part = engine.executor.run_forward(engine.step_data(step, dataset), metric)
            sums = torch.tensor(part, dtype=torch.float64)
            comm.wait_work(dist.all_reduce(sums, group=engine.control_group, async_op=True), engine.timeout, -1,
                           "evaluation all-reduce")
            total += sums
    except PeerError as error:
        raise engine.diagnose(error) from None
    finally:
        if stage is not None:
            stage.train()
    return EvalResult(float(total[0]) / steps, float(total[1]) / steps if metric is not None else None, steps)


def evaluate_in_process(modules: list[nn.Module], forward: Callable[[Any, Any], Any], criterion: Callable, dataset: Any,
                        num_microbatches: int, steps: int, metric: Optional[Metric] = None) -> EvalResult:
    """Forward-only in this process: `forward(inputs, microbatch_inputs) -> output` per microbatch, `modules` in
    eval mode meanwhile (and back to train mode after); the loss and metric / m summed per step, then averaged."""
    _check_steps(steps, dataset)
    loss_sum = metric_sum = 0.0
    for module in modules:
        module.eval()
    try:
        with torch.no_grad():
            for step in range(steps):
                inputs, target = dataset.batch(step)
                for mb_inputs, mb_target in minibatch_parts(inputs, target, num_microbatches, f"minibatch {step}"):
                    output = forward(inputs, mb_inputs)
                    loss_sum += float(criterion(output, mb_target)) / num_microbatches
                    metric_sum += float(metric(output, mb_target)) / num_microbatches if metric is not None else 0.0
    finally:
        for module in modules:
            module.train()
    return EvalResult(loss_sum / steps, metric_sum / steps if metric is not None else None, steps)


def single_process_evaluate(model: nn.Module, criterion: Callable[[Any, torch.Tensor], torch.Tensor], dataset: Any,
                            num_microbatches: int, steps: int, metric: Optional[Metric] = None) -> EvalResult:
    """The oracle: the original model in eval mode, per microbatch criterion / m, the same microbatching."""

    def forward(inputs: Any, mb_inputs: Any) -> Any:
        return model(**mb_inputs[0]) if isinstance(inputs, Mapping) else model(*mb_inputs)

    return evaluate_in_process([model], forward, criterion, dataset, num_microbatches, steps, metric)
