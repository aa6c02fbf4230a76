"""The training loop of a `PipelineEngine` and one step of it (`TrainingLoop`, the engine's `train` and
`train_step`): per step the rank's schedule actions (executor.py), the gradient all-reduces, the loss
all-reduce and the update; validation every `eval_every` steps, checkpoints, the control path after every
step, a progress bar on rank 0, and the trace and metrics files closed at the end whatever happens. (A
validation runs inside its step's metrics window: that step's `step_ms` includes `eval_ms`, and its JSONL
line carries `val_loss`.)"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import torch

from model_parallel.errors import PeerError
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, ControlChannel, StepReport
from model_parallel.runtime.build.replicas import ReplicaGroups, all_reduce_grads
from model_parallel.runtime.build.tied import TiedCopies
from model_parallel.runtime.checkpoint import resume
from model_parallel.runtime.step import stop_signals
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.observe.memory_probe import NullMeter, StashMeter
from model_parallel.runtime.observe.metrics import MetricsRecorder, StepLog
from model_parallel.runtime.observe.straggler import Slowdown
from model_parallel.runtime.observe.tracing import Tracer
from model_parallel.runtime.step.evaluate import EvalResult
from model_parallel.runtime.step.executor import StepData, StepExecutor
from model_parallel.runtime.step.schedule import Schedule
from model_parallel.runtime.step.update import apply_update, squared_grad_norm
from model_parallel.runtime.wire import step_totals
from model_parallel.runtime.wire.loop_priority import lower_loop_threads

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
    stop_reason: Optional[str]  # why the loop ended before `steps` (a stop command or signal); None otherwise
    stop_requests: int  # ranks a signal asked to stop, as the last step's reduction counted (runtime/step/stop_signals.py)
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


def run_loop(engine: LoopingEngine, steps: int, start_step: int = 0) -> None:
    """Run `engine` (every rank together) from `start_step` (or the checkpoint it resumes from) up to
    `steps`. A stop command ends it early: then `engine.stop_reason` says why; `engine.next_step`
    is how far it got."""
    opts = engine.options
    start_step = resume.prepare(engine, start_step)
    progress = _progress_bar(steps, start_step) if engine.rank == 0 and opts.progress else None
    step = engine.next_step = engine.start_step = start_step
    engine.stop_reason, engine.stop_requests = None, 0
    try:
        with stop_signals.armed():
            _steps(engine, step, steps, start_step, progress)
        engine.barrier()  # nobody leaves while a peer may still need it
    finally:
        if progress is not None:
            progress.close()
        if opts.trace_dir:
            engine.tracer.save(Path(opts.trace_dir) / f"rank{engine.rank}.json")
        engine.metrics.close()


def _steps(engine: LoopingEngine, step: int, steps: int, start_step: int, progress: Any) -> None:
    """Steps `step`..`steps - 1`, each with its validation, metrics, progress, checkpoint and control; a stop
    command or a stop signal ends them early at a step boundary (`engine.stop_reason` says why)."""
    opts = engine.options
    step_log = StepLog(start_step, steps - 1)
    last_validation: dict[str, str] = {}
    while step < steps:
        result = engine.train_step(step)
        validation = _validate(engine, step, steps)  # before end_step: the step's JSONL line carries it
        record = engine.metrics.end_step(samples=engine.config.batch_size, loss=result.loss, lr=result.lr,
                                         grad_norm=result.grad_norm, pause_ms=engine.step_pause_ms,
                                         **engine.meter.record(), **validation)
        if step == start_step:  # gloo names a loop thread from inside it: one made just before the plan's
            lower_loop_threads(opts.gloo_loop_nice)  # activation may have had no name yet then (a race)
        if "val_loss" in validation:
            result.extra["val_loss"] = validation["val_loss"]
            last_validation = {"val_loss": f"{validation['val_loss']:.4f}"}
        if progress is not None:  # refresh=False: the bar's own mininterval decides when it is drawn
            progress.set_postfix(loss=f"{result.loss:.4f}", **last_validation, plan=engine.plan.version, refresh=False)
            progress.update(1)
        if step_log.due(step) or validation:  # bounded: every step at first, then one line per 10 s
            logger.info("%s step %d loss %.6f%s", engine.prefix, step, result.loss,
                        f" val_loss {validation['val_loss']:.6f}" if validation else "")
        saved = opts.checkpoint_dir and ((opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0)
                                         or step + 1 == steps)
        if saved:
            engine.save_checkpoint(step)
        if engine.stop_requests and step + 1 < steps:  # every rank sees the same count at the same step
            engine.stop_reason = _signal_reason()
            step = engine.next_step = step + 1
            if opts.checkpoint_dir and not saved:
                engine.save_checkpoint(step - 1)
            break
        command = engine.control(step, record.to_report())  # the record carries stage and loss
        step += 1
        engine.next_step = step
        if command is not None and not engine.apply(command):
            engine.stop_reason = command.reason or "stop requested"
            if opts.checkpoint_dir:
                engine.save_checkpoint(step - 1)
            break


def _signal_reason() -> str:
    mine = stop_signals.requested()
    # Not a count of ranks: one whose signal came after it posted its part is counted a step later, or never.
    who = f"this rank got {mine}" if mine else "another rank got a stop signal (SIGTERM or SIGINT)"
    return f"{who}; every rank stopped at the same step boundary (runtime/step/stop_signals.py)"


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
    """tqdm on stderr, redrawn at most every 0.1 s on a terminal; into a file or a pipe (a job's log) at most
    once per `StepLog`'s interval (10 s): each redraw there is a new ~120-byte record, never overwritten, and one
    per step made the bar 95 % of a worker's log (0.5 MB per 4,000 steps, growing with the run)."""
    import sys

    from tqdm import tqdm

    interactive = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                mininterval=0.1 if interactive else StepLog.DEFAULT_INTERVAL_S)


class SteppingEngine(LoopingEngine, Protocol):
    """What `TrainingLoop` needs of the engine it is part of, beyond the loop's members."""

    straggler: Slowdown
    pending_migration_s: float  # a plan switch's pause, counted in the next step's metrics
    executor: Optional[StepExecutor]
    stage: Any
    optimizer: Optional[torch.optim.Optimizer]
    tied: TiedCopies
    num_replicas: int
    stage_id: Optional[int]
    stage_ids: tuple[int, ...]  # every stage this rank holds (several: interleaved 1F1B)
    replica_groups: ReplicaGroups
    control_group: Any
    channel: ControlChannel  # rank 0 polls it for the command that rides in the step's reduction
    health: Any  # wire/health.Health, or None (no heartbeats: single process, tests)
    command: Optional[Command]  # the command the last reduction carried, until `control` hands it out
    schedule: Schedule
    updates: int
    history: deque[StepResult]

    @property
    def timeout(self) -> float: ...

    def step_data(self, step: int, dataset: Any = None) -> StepData: ...

    def diagnose(self, error: PeerError) -> PeerError: ...

    def raise_if_out_of_memory(self, error: BaseException, stage_id: Optional[int]) -> None: ...


class TrainingLoop:
    """`PipelineEngine.train` and `train_step`: the loop and one step live here, beside each other, so a
    step reads top to bottom from `PipelineTrainer.train` through this module to the executor and the wire."""

    def train(self: SteppingEngine, steps: int, start_step: int = 0) -> list[StepResult]:
        """Run steps [start_step, steps); all ranks together. Returns this rank's per-step results (the
        last `engine.HISTORY_WINDOW` of them). A stop command ends it early: then `stop_reason` says why and
        `next_step` how far it got."""
        if self.health is not None:
            self.health.announce_end_step(steps)  # ranks run to different steps: named by the diagnosis
        try:
            run_loop(self, steps, start_step)
        except (MemoryError, RuntimeError) as error:
            self.raise_if_out_of_memory(error, self.stage_id)
            raise
        return list(self.history)

    def train_step(self: SteppingEngine, step: int) -> StepResult:
        """One step on this rank: its schedule actions, the gradient all-reduces, the step's one reduction
        ([loss, norm, command length]: wire/step_totals.py) and the update."""
        self.straggler.at_step(step)
        self.metrics.begin_step(step)
        # A plan switch happened after the previous step: its pause counts in this step's metrics.
        self.step_pause_ms = self.pending_migration_s * 1e3
        if self.pending_migration_s:
            self.metrics.add_before_step("migration", self.pending_migration_s)
            self.pending_migration_s = 0.0
        clip = self.config.clip_grad
        loss_sum, sq = 0.0, 0.0
        # A rank whose share of the reduction the step does not compute (no loss: not the last stage; no
        # norm: no clipping) posts it early: it then runs during the step, not on the critical path after it;
        # once the step's urgent work is posted (`started`: its first activation sent, or its first receives
        # posted), not before it: each post costs ~0.1 ms of this thread on the 2-core VM.
        early = clip is None and self.plan.num_stages - 1 not in self.stage_ids  # interleaved: any of its stages
        # The root posts its receives early too, after its activation receives (gloo sends only into a posted
        # receive: comm.py); its own part follows the step's work (`contribute`).
        root = self.rank == step_totals.root_rank(self.plan)
        posted: Optional[step_totals.Posted] = None

        def post_early() -> None:
            nonlocal posted
            posted = _post_totals(self, step, 0.0, 0.0)
        try:
            if self.executor is not None:
                data = self.step_data(step)
                with self.meter.step(self.stage, (data.inputs, data.targets)):
                    loss_sum = self.executor.run(step, data, self.straggler.compute,
                                                 started=post_early if early or root else None)
                self.meter.held(self.stage, self.optimizer)  # gradients present, optimizer state of earlier steps
                tied = self.tied.param_ids
                if tied:  # first, on each replica's own gradient: the sum covers every replica's microbatches
                    with self.metrics.measure("allreduce"):
                        self.tied.all_reduce_grads(self.timeout)
                if self.num_replicas > 1:
                    assert self.stage_id is not None  # an executor runs only on a rank with a stage
                    with self.metrics.measure("allreduce"):
                        all_reduce_grads(self.stage, self.replica_groups.group(self.plan.stages[self.stage_id].ranks),
                                         self.timeout, skip=tied)
                if clip is not None:
                    # Only when clipping: a pass over every gradient costs a few % of a step. Each
                    # replica holds the whole stage gradient: count it once (a tied copy: once over its holders).
                    untied = [p for p in self.stage.parameters() if id(p) not in tied]
                    sq = squared_grad_norm(untied) / self.num_replicas + self.tied.squared_norm()
            if posted is None:
                posted = _post_totals(self, step, loss_sum, sq)
            elif root:
                posted.contribute(loss_sum, sq, stop_signals.requested() is not None)
            assert not early or loss_sum == 0.0, "a stage other than the last reported a loss"
            # The update needs the global norm first when clipping. The root (the last stage's rank)
            # completes the reduction before its update in any case: the other parts were posted when
            # the step began, and the sums it sends back are then on their way before its update.
            if clip is not None or root:
                _wait_totals(self, posted)
        except PeerError as error:
            raise self.diagnose(error) from None
        lr = 0.0
        if self.optimizer is not None and not self.schedule.flush:
            lr = self.optimizer.param_groups[0]["lr"]  # updated after every microbatch already
        elif self.optimizer is not None:
            with self.metrics.measure("optimizer"):
                lr = apply_update(self.optimizer, step, lr_schedule=self.config.lr_schedule, clip_grad=clip,
                                  total_norm=float(posted.totals[1]) ** 0.5 if clip is not None else None)
            self.updates += 1
        try:
            if clip is None and not root:  # only feeds the report: it ran during the step and update
                _wait_totals(self, posted)
            sums = step_totals.unpack(posted.totals)
            if sums.command_bytes:  # rare: rank 0 announced a command; its JSON follows (metrics: control_ms)
                with self.metrics.measure("control"):
                    self.command = step_totals.receive_command(sums, posted.payload, self.control_group, self.timeout)
        except PeerError as error:
            raise self.diagnose(error) from None
        self.stop_requests = sums.stop_requests
        result = StepResult(step, sums.loss, sums.squared_norm ** 0.5, lr)
        self.history.append(result)
        return result


def _post_totals(engine: SteppingEngine, step: int, loss_sum: float, squared_norm: float) -> step_totals.Posted:
    """Start the step's one reduction; rank 0 first polls its channel: the decision rides in it
    (wire/step_totals.py) and every rank applies it after this step."""
    command = engine.channel.poll(before_step=step + 1) if engine.rank == 0 else None
    return step_totals.post(loss_sum, squared_norm, command, engine.control_group, step_totals.root_rank(engine.plan),
                            stop=stop_signals.requested() is not None)


def _wait_totals(engine: SteppingEngine, posted: step_totals.Posted) -> None:
    with engine.metrics.measure("allreduce"):
        posted.wait(engine.timeout)
