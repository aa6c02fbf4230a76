"""The training loop of a `PipelineEngine`: steps, checkpoints, the control path after every step, a
progress bar on rank 0, and the trace and metrics files closed at the end whatever happens."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from model_parallel.runtime import engine_checkpoint
from model_parallel.runtime.metrics import StepLog

logger = logging.getLogger(__name__)


def train(engine: Any, steps: int, start_step: int = 0) -> None:
    """Run `engine` (every rank together) from `start_step` (or the checkpoint it resumes from) up to
    `steps`. A stop command ends it early: then `engine.stop_reason` says why; `engine.next_step`
    is how far it got."""
    opts = engine.options
    start_step = engine_checkpoint.prepare(engine, start_step)
    progress = _progress_bar(steps, start_step) if engine.rank == 0 and opts.progress else None
    step = engine.next_step = start_step
    step_log = StepLog(start_step, steps - 1)
    engine.stop_reason = None
    try:
        while step < steps:
            result = engine.train_step(step)
            record = engine.metrics.end_step(samples=engine.config.batch_size, loss=result.loss, lr=result.lr,
                                             grad_norm=result.grad_norm, pause_ms=engine.step_pause_ms,
                                             **engine.meter.record())
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{result.loss:.4f}", plan=engine.plan.version)
            if step_log.due(step):  # bounded: every step at first, then one line per 10 s
                logger.info("%s step %d loss %.6f", engine.prefix, step, result.loss)
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


def _progress_bar(total: int, initial: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
