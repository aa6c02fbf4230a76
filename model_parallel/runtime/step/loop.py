"""The training loop of a `PipelineEngine`: steps, validation every `eval_every` steps, checkpoints, the
control path after every step, a progress bar on rank 0, and the trace and metrics files closed at the
end whatever happens. (A validation runs inside its step's metrics window: that step's `step_ms` includes
`eval_ms`, and its JSONL line carries `val_loss`.)"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Union

from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, StepReport
from model_parallel.runtime.checkpoint import resume
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.observe.memory_probe import NullMeter, StashMeter
from model_parallel.runtime.observe.metrics import MetricsRecorder, StepLog
from model_parallel.runtime.observe.tracing import Tracer
from model_parallel.runtime.step.evaluate import EvalResult

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float  # global gradient norm before clipping; 0.0 when not clipping (not computed)
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)


class LoopingEngine(resume.StartingEngine, Protocol):
    """What the loop needs of a rank's engine (`PipelineEngine` is one); it writes the three step fields."""

    config: TrainConfig
    plan: Plan
    next_step: int  # the first step not yet run
    start_step: int
    stop_reason: Optional[str]  # why the loop ended before `steps` (a stop command); None otherwise
    step_pause_ms: float  # time this step spent paused for a plan switch
    metrics: MetricsRecorder
    meter: Union[StashMeter, NullMeter]
    tracer: Tracer
    eval_dataset: Any  # anything with `batch(step)`, or None: no validation

    def train_step(self, step: int) -> StepResult: ...

    def evaluate(self, dataset: Any, steps: int, metric: Any = None) -> EvalResult: ...

    def save_checkpoint(self, step: int) -> None: ...

    def control(self, step: int, report: StepReport) -> Optional[Command]: ...

    def apply(self, command: Command) -> bool: ...

    def barrier(self) -> None: ...


def train(engine: LoopingEngine, steps: int, start_step: int = 0) -> None:
    """Run `engine` (every rank together) from `start_step` (or the checkpoint it resumes from) up to
    `steps`. A stop command ends it early: then `engine.stop_reason` says why; `engine.next_step`
    is how far it got."""
    opts = engine.options
    start_step = resume.prepare(engine, start_step)
    progress = _progress_bar(steps, start_step) if engine.rank == 0 and opts.progress else None
    step = engine.next_step = engine.start_step = start_step
    step_log = StepLog(start_step, steps - 1)
    engine.stop_reason = None
    last_validation: dict[str, str] = {}
    try:
        while step < steps:
            result = engine.train_step(step)
            validation = _validate(engine, step, steps)  # before end_step: the step's JSONL line carries it
            record = engine.metrics.end_step(samples=engine.config.batch_size, loss=result.loss, lr=result.lr,
                                             grad_norm=result.grad_norm, pause_ms=engine.step_pause_ms,
                                             **engine.meter.record(), **validation)
            if "val_loss" in validation:
                result.extra["val_loss"] = validation["val_loss"]
                last_validation = {"val_loss": f"{validation['val_loss']:.4f}"}
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{result.loss:.4f}", **last_validation, plan=engine.plan.version)
            if step_log.due(step) or validation:  # bounded: every step at first, then one line per 10 s
                logger.info("%s step %d loss %.6f%s", engine.prefix, step, result.loss,
                            f" val_loss {validation['val_loss']:.6f}" if validation else "")
            if opts.checkpoint_dir and ((opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0)
                                        or step + 1 == steps):
                engine.save_checkpoint(step)
            command = engine.control(step, record.to_report())  # the record carries stage and loss
            step += 1
            engine.next_step = step
            if command is not None and not engine.apply(command):
                engine.stop_reason = command.reason or "stop requested"
                if opts.checkpoint_dir:
                    engine.save_checkpoint(step - 1)
                break
        engine.barrier()  # nobody leaves while a peer may still need it
    finally:
        if progress is not None:
            progress.close()
        if opts.trace_dir:
            engine.tracer.save(Path(opts.trace_dir) / f"rank{engine.rank}.json")
        engine.metrics.close()


def _validate(engine: LoopingEngine, step: int, steps: int) -> dict[str, float]:
    """Every `eval_every` steps and after the last one (with eval data): the validation loss and how long it took."""
    opts = engine.options
    data = engine.eval_dataset
    if data is None or not opts.eval_every or not ((step + 1) % opts.eval_every == 0 or step + 1 == steps):
        return {}
    start = time.perf_counter()
    result = engine.evaluate(data, opts.eval_steps)
    return {"val_loss": result.loss, "eval_ms": (time.perf_counter() - start) * 1e3}


def _progress_bar(total: int, initial: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
