"""One rank of a running pipeline: its stage under the current plan, the step loop and the control path.

Per step, on a rank holding replica i of stage k (of p stages, r_k replicas, m microbatches):

    run the rank's schedule actions (executor.py: forwards, backwards, sends, receives)
    all-reduce the grads of tied copies over every rank holding one (tied.py: a tie split across stages)
    all-reduce the other grads among the stage's replicas (replicas.py; sum: the loss is already / m)
    one reduction over all ranks of [loss, squared grad norm, command length], through rank 0
             (wire/step_totals.py: clipping by global norm; rank 0 polls its ControlChannel just
             before and announces its decision - continue / switch plan / stop / slowdown - whose
             JSON follows only if any)
    the update (update.py: clip, this step's learning rate, optimizer step); metrics; checkpoint
    control: every rank reports metrics to its ControlChannel and applies the command of this step

So the sum of microbatch gradients is the gradient of the minibatch-mean loss, and after every
flush the parameters equal single-process training with the same microbatching. Spare ranks
(no stage) only take part in the reduction (and a command's broadcast). With the `pipedream`
schedule (no flush) each microbatch is its own update (see executor.WeightStash).
"""
from __future__ import annotations

import gc

import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from model_parallel.allocator import return_freed_memory
from model_parallel.codegen.build import build_stage
from model_parallel.errors import ModelParallelError, PeerError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, ControlChannel, NullChannel, StepReport
from model_parallel.runtime.build.materialize import Initializer, graph_constants, is_meta, materialize_layers, release_layers
from model_parallel.runtime.build.replicas import ReplicaGroups, all_reduce_grads
from model_parallel.runtime.build.stages import check_plan_fits, layer_modules, stage_layers
from model_parallel.runtime.build.tied import TiedCopies
from model_parallel.runtime.checkpoint import resume
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.data.batches import minibatch_parts, stage_zero_inputs
from model_parallel.runtime.observe.memory_probe import NO_METER, StashMeter
from model_parallel.runtime.observe.straggler import Slowdown
from model_parallel.runtime.plancheck import check_plan
from model_parallel.runtime.step.executor import Microbatches, StepExecutor, WeightStash
from model_parallel.runtime.step.loop import StepResult, train as train_loop
from model_parallel.runtime.step.output import model_output
from model_parallel.runtime.step.schedule import make_schedule
from model_parallel.runtime.step.update import apply_update, squared_grad_norm
from model_parallel.runtime.wire import comm, step_totals
from model_parallel.runtime.wire.agreement import check_same_job, graph_digest

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
# Per-step results kept in memory (a long run would otherwise grow by every step; the metrics JSONL
# on disk keeps them all).
HISTORY_WINDOW = 1000


class PipelineEngine:
    """A rank's view of the pipeline. Build it after `init_process_group`, on every rank, with the same
    graph, plan, seed-built model and config; then call `train(steps)` on all ranks. It satisfies
    `migration.MigratingEngine`."""

    def __init__(
        self,
        *,
        graph: Graph,
        plan: Plan,
        model: nn.Module,
        criterion: Callable[[Any, torch.Tensor], torch.Tensor],
        optimizer_factory: OptimizerFactory,
        dataset: Any,
        config: TrainConfig,
        options: RunOptions = RunOptions(),
        channel: Optional[ControlChannel] = None,
        health: Any = None,
        device: Optional[torch.device] = None,
        control_group: Any = None,
        initializer: Any = None,
        eval_dataset: Any = None,
    ) -> None:
        from model_parallel.allocator import keep_freed_memory
        from model_parallel.runtime.observe.metrics import MetricsRecorder
        from model_parallel.runtime.observe.tracing import Tracer

        keep_freed_memory()  # steady per-step allocation cost (see model_parallel/allocator.py)
        self.graph, self.model, self.criterion = graph, model, criterion
        self.optimizer_factory, self.dataset, self.config, self.options = optimizer_factory, dataset, config, options
        self.eval_dataset = eval_dataset  # validated on every `options.eval_every` steps (loop.py)
        self.channel = channel or NullChannel()
        self.health = health
        self.device = device or torch.device("cpu")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.control_group = control_group if control_group is not None else dist.new_group(backend="gloo")
        self.modules = layer_modules(graph, model)
        self.graph_hash = graph_digest(graph)  # checked against every other rank's at each activation
        # A model built on meta: this rank allocates its stage's layers only (runtime/build/materialize.py).
        self.initializer = initializer or Initializer(seed=config.seed, model=model)
        self.lazy_layers = {name for name, obj in self.modules.items() if is_meta(obj)}  # freed when they leave
        trace_file = os.path.join(options.trace_dir, f"rank{self.rank}.json") if options.trace_dir else None
        self.tracer = Tracer(self.rank, enabled=bool(options.trace_dir), stream=trace_file)  # loop.py closes it
        self.metrics = MetricsRecorder(self.rank, path=options.metrics, tracer=self.tracer)
        if self.tracer.enabled and hasattr(dataset, "attach_tracer"):
            dataset.attach_tracer(self.tracer)  # a Prefetcher: its data spans join this rank's trace
        self.straggler = Slowdown(self.metrics, self.rank, options.straggler)  # runs forwards and backwards
        self.replica_groups = ReplicaGroups(self.device)
        # Boundary headers (shapes/dtypes) are sent once per (peer, tag) and then only on change.
        self.header_cache = comm.HeaderCache()
        self._pending_migration_s = 0.0
        self.step_pause_ms = 0.0
        self.switch_pauses_ms: list[float] = []
        self.updates = 0  # optimizer updates after a flush applied by this rank (PipeDream: see WeightStash)
        self.history: deque[StepResult] = deque(maxlen=HISTORY_WINDOW)  # the latest steps' results
        self.next_step = 0  # the first step not yet run (after `train`: how far it got)
        self.start_step = 0  # the step `train` started from (after a resume: the checkpoint's next step)
        self.stop_reason: Optional[str] = None  # why `train` ended before its requested steps (a stop command)
        self.command: Optional[Command] = None  # the command of the last step's reduction, until `control` hands it out
        self._checkpointed_step: Optional[int] = None  # the step of the last checkpoint this run committed
        self.stage: Any = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.executor: Optional[StepExecutor] = None
        self.meter = StashMeter(self.device) if options.measure_memory else NO_METER
        try:
            self.activate(plan)
        except (MemoryError, RuntimeError) as error:  # materializing the stage: its weights did not fit
            self._raise_if_out_of_memory(error, plan.with_default_ranks().stage_of_rank(self.rank))
            raise

    @property
    def prefix(self) -> str:
        return f"[rank {self.rank} stage {self.stage_id if self.stage_id is not None else '-'}]"

    @property
    def timeout(self) -> float:
        """Seconds any blocking communication may take."""
        return self.options.timeout

    @property
    def slowdown(self) -> float:
        """Compute time multiplier of this rank (1.0: off; see straggler.py)."""
        return self.straggler.factor

    @slowdown.setter
    def slowdown(self, factor: float) -> None:
        self.straggler.set(factor)

    # ---- plan --------------------------------------------------------------------------------------
    def activate(self, plan: Plan, optimizer_state: Optional[dict[str, dict[str, Any]]] = None) -> None:
        """Build this rank's stage and optimizer for `plan` (collective: every rank calls it together)."""
        plan = plan.with_default_ranks()
        check_plan_fits(plan, self.world_size)
        check_same_job(self.graph_hash, plan, self.config, self.control_group, self.timeout)
        # On every rank alike, before anything changes; the coordinator runs the same check (runtime.plancheck).
        checked = check_plan(self.graph, plan, self.world_size, self.config.schedule, self.modules)
        ties = checked.ties
        self.plan = plan
        self.header_cache.clear()  # every rank together, with nothing in flight: both ends agree
        self.boundaries = checked.boundaries
        self.replica_groups.create_for(plan)
        self.stage_id = plan.stage_of_rank(self.rank)
        self.schedule = make_schedule(self.config.schedule, plan.num_stages, self.config.num_microbatches)
        self.optimizer, self.stage, self.executor = None, None, None
        keep = set(stage_layers(self.graph, plan, self.stage_id)) if self.stage_id is not None else set()
        left = sorted(self.lazy_layers - keep)
        release_layers(self.modules, left)  # layers that left this rank
        self.replica, self.num_replicas = 0, 1
        if self.stage_id is not None:
            self._build_stage(self.stage_id, optimizer_state)
        if left:  # their values, gradients and optimizer state are gone: give the memory back to the OS
            gc.collect()
            return_freed_memory()
        # A tie split across stages: its holders form a group (created on every rank, in the same order).
        self.tied = TiedCopies(ties, self.rank, self.stage_id, self.stage, self.replica_groups.group)
        self.check_tied(f"when plan v{plan.version} was activated")
        self.tracer.set_context(stage=self.stage_id, plan_version=plan.version)
        self.metrics.set_context(self.stage_id, plan.version)

    def _build_stage(self, stage_id: int, optimizer_state: Optional[dict[str, dict[str, Any]]]) -> None:
        sp = self.plan.stages[stage_id]
        self.replica, self.num_replicas = sp.ranks.index(self.rank), sp.num_replicas
        materialize_layers(self.modules, stage_layers(self.graph, self.plan, stage_id), self.initializer, self.device,
                           self.graph, graph_constants(self.graph, self.modules))
        self.stage = build_stage(self.graph, sp.node_ids, self.boundaries[stage_id], modules=self.modules,
                                 class_name=f"Stage{stage_id}").to(self.device)
        self.stage.train()
        params = list(self.stage.parameters())
        if params:
            self.optimizer = self.optimizer_factory(params)
            if optimizer_state:
                from model_parallel.runtime.checkpoint.store import load_optimizer_state_by_name

                load_optimizer_state_by_name(self.optimizer, dict(self.stage.named_parameters()), optimizer_state, copy=False)
        stash = None
        if not self.schedule.flush and self.optimizer is not None:
            stash = WeightStash(self.stage, self.optimizer, self.config.lr_schedule, self.metrics, HISTORY_WINDOW)
        names = self.stage.output_names
        self.executor = StepExecutor(
            stage=self.stage, stage_id=stage_id, num_stages=self.plan.num_stages,
            actions=self.schedule.rank_actions(stage_id, self.replica, self.num_replicas), route=self.rank_of,
            config=self.config, criterion=self.criterion, decode=lambda outputs: model_output(self.graph, names, outputs),
            device=self.device, header_cache=self.header_cache, metrics=self.metrics, timeout=self.timeout,
            flush=self.schedule.flush, weight_stash=stash)
        self.executor.meter = self.meter

    def check_tied(self, when: str) -> None:
        """Collective: the copies of every tie split across stages are identical (a dead peer is named)."""
        try:
            self.tied.check_identical(self.timeout, when)
        except PeerError as error:
            raise self.diagnose(error) from None

    def rank_of(self, stage: int, microbatch: int) -> int:
        ranks = self.plan.stages[stage].ranks
        return ranks[microbatch % len(ranks)]

    def named_state(self) -> dict[str, torch.Tensor]:
        """This rank's stage parameters and buffers by stage-module name (empty on a spare)."""
        return dict(self.stage.state_dict()) if self.stage is not None else {}

    # ---- one step --------------------------------------------------------------------------------------
    def microbatches(self, step: int, dataset: Any = None) -> Optional[Microbatches]:
        """Stage 0's microbatches of `step` of `dataset` (default: the training data); None on other stages."""
        if self.stage_id != 0:
            return None  # later stages receive theirs
        # A dict of keyword inputs (Hugging Face) is moved key by key and fed in the graph's placeholder order.
        batch = (dataset or self.dataset).batch(step)
        inputs, target = tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, batch)
        graph_inputs = self.graph.metadata.get("inputs") or ()
        return [(stage_zero_inputs(graph_inputs, inputs, mb), t)
                for mb, t in minibatch_parts(inputs, target, self.config.num_microbatches)]

    def train_step(self, step: int) -> StepResult:
        self.straggler.at_step(step)
        self.metrics.begin_step(step)
        # A plan switch happened after the previous step: its pause counts in this step's metrics.
        self.step_pause_ms = self._pending_migration_s * 1e3
        if self._pending_migration_s:
            self.metrics.add_before_step("migration", self._pending_migration_s)
            self._pending_migration_s = 0.0
        clip = self.config.clip_grad
        loss_sum, sq = 0.0, 0.0
        # A rank whose share of the reduction the step does not compute (no loss: not the last stage; no
        # norm: no clipping) posts it first: it then runs during the step, not on the critical path after it.
        early = clip is None and self.stage_id != self.plan.num_stages - 1
        try:
            posted = self._post_totals(step, 0.0, 0.0) if early else None
            if self.executor is not None:
                microbatches = self.microbatches(step)
                with self.meter.step(self.stage, microbatches):
                    loss_sum = self.executor.run(step, microbatches, self.straggler.compute)
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
                posted = self._post_totals(step, loss_sum, sq)
            assert not early or loss_sum == 0.0, "a stage other than the last reported a loss"
            if clip is not None:  # the update needs the global norm first
                self._wait_totals(posted)
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
            if clip is None:  # without clipping the reduction only feeds the report: it ran during the step and update
                self._wait_totals(posted)
            sums = step_totals.unpack(posted.totals)
            if sums.command_bytes:  # rare: rank 0 announced a command; its JSON follows (metrics: control_ms)
                with self.metrics.measure("control"):
                    self.command = step_totals.receive_command(sums, posted.payload, self.control_group, self.timeout)
        except PeerError as error:
            raise self.diagnose(error) from None
        result = StepResult(step, sums.loss, sums.squared_norm ** 0.5, lr)
        self.history.append(result)
        return result

    def _post_totals(self, step: int, loss_sum: float, squared_norm: float) -> step_totals.Posted:
        """Start the step's one reduction; rank 0 first polls its channel: the decision rides in it
        (wire/step_totals.py) and every rank applies it after this step."""
        command = self.channel.poll(before_step=step + 1) if self.rank == 0 else None
        return step_totals.post(loss_sum, squared_norm, command, self.control_group)

    def _wait_totals(self, posted: step_totals.Posted) -> None:
        with self.metrics.measure("allreduce"):
            posted.wait(self.timeout)

    def diagnose(self, error: PeerError) -> PeerError:
        """`error` with this rank's prefix and, when heartbeats run, the peer that died."""
        if self.health is None:
            return PeerError(f"{self.prefix} {error}")
        return PeerError(f"{self.prefix} {self.health.diagnose(error)}")


    def evaluate(self, dataset: Any, steps: int, metric: Any = None) -> Any:
        """Forward-only over `steps` minibatches of `dataset` (all ranks together): `evaluate.EvalResult`."""
        from model_parallel.runtime.step.evaluate import evaluate_pipeline

        return evaluate_pipeline(self, dataset, steps, metric)

    # ---- control --------------------------------------------------------------------------------
    def control(self, step: int, report: StepReport) -> Optional[Command]:
        """Report the step to this rank's channel; return the command every rank received in the step's
        reduction (rank 0 polled for it in `train_step`), to be applied before the next step."""
        self.channel.report(report)
        command, self.command = self.command, None
        return command

    def apply(self, command: Command) -> bool:
        """Act on a broadcast command; False means stop."""
        if command.kind == "stop":
            logger.warning("%s stopping: %s", self.prefix, command.reason or "stop requested")
            return False
        if command.kind == "slowdown":
            if command.rank == self.rank:
                logger.warning("%s compute slowed down %.2fx (%s)", self.prefix, command.factor, command.reason)
                self.slowdown = float(command.factor)
        elif command.kind == "switch":
            from model_parallel.runtime.wire.migration import switch_plan

            new_plan = command.plan
            assert new_plan is not None  # Command refuses a switch without a plan
            try:  # before anything moves; every rank reaches the same verdict (same graph, plan, world, schedule)
                check_plan(self.graph, new_plan, self.world_size, self.config.schedule, self.modules)
            except ModelParallelError as error:
                logger.error("%s refusing the switch to plan v%d (%s): %s; training goes on with plan v%d", self.prefix,
                             new_plan.version, command.reason or "no reason given", error, self.plan.version)
                refused = getattr(self.channel, "switch_refused", None)  # tell the coordinator (rank 0's channel)
                if self.rank == 0 and refused is not None:
                    refused(new_plan.version, str(error))
                return True
            try:
                # A span for the pause (the docs' `migration` lane): without it the trace showed only a gap.
                with self.tracer.span(f"migration to plan v{new_plan.version}", lane="migration",
                                      plan_version=new_plan.version):
                    pause = switch_plan(self, new_plan)
            except PeerError as error:
                raise self.diagnose(error) from None
            self.switch_pauses_ms.append(pause * 1e3)
            self._pending_migration_s += pause
            self.tracer.instant(f"switch to plan v{new_plan.version}")
            if self.rank == 0:
                logger.warning("%s switched to plan v%d in %.1f ms%s", self.prefix, new_plan.version, pause * 1e3,
                               f" ({command.reason})" if command.reason else "")
        return True


    # ---- checkpoints ------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """The model's parameter names (as stage modules name them), shapes and dtypes, hashed."""
        return resume.fingerprint(self.graph, self.model)

    def save_checkpoint(self, step: int) -> None:
        """All ranks: first replicas write their stage's shard, rank 0 commits once all agree they did."""
        from model_parallel.runtime.checkpoint.commit import save_and_commit

        if step == self._checkpointed_step:
            return  # a stop right after a checkpoint: rewriting the committed one in place could corrupt it
        self.check_tied(f"at the checkpoint of step {step}")  # a tie is stored once: its copies must agree
        save_and_commit(self, step)
        self._checkpointed_step = step

    def training_record(self, next_step: int) -> dict[str, Any]:
        """This run's training configuration and data position at `next_step` (what a checkpoint records)."""
        from model_parallel.runtime.checkpoint.training_record import training_record

        return training_record(self.config, self.dataset, next_step)

    def load_checkpoint(self) -> int:
        """Restore this rank's stage from the latest checkpoint (any partition); returns the next step."""
        return resume.restore(self)

    def barrier(self) -> None:
        try:
            flag = torch.zeros(1)
            comm.wait_work(dist.all_reduce(flag, group=self.control_group, async_op=True), self.timeout, -1, "barrier")
        except PeerError as error:
            raise self.diagnose(error) from None

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self, steps: int, start_step: int = 0) -> list[StepResult]:
        """Run steps [start_step, steps); all ranks together. Returns this rank's per-step results (the
        last HISTORY_WINDOW of them). A stop command ends it early: then `stop_reason` says why and
        `next_step` how far it got."""
        try:
            train_loop(self, steps, start_step)
        except (MemoryError, RuntimeError) as error:
            self._raise_if_out_of_memory(error, self.stage_id)
            raise
        return list(self.history)

    def _raise_if_out_of_memory(self, error: BaseException, stage_id: Optional[int]) -> None:
        """An allocation refused becomes one line (`memory_probe.out_of_memory`), published as this rank's
        failure first: its peers then name it and why, not a flag mismatch. Other errors pass."""
        from model_parallel.runtime.observe.memory_probe import out_of_memory

        oom = out_of_memory(error, self.rank, stage_id, self.stage, self.optimizer, self.device)
        if oom is None:
            return
        if self.health is not None:
            self.health.stop("failed", None, str(oom))
        raise oom from None
