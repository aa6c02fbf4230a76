"""One rank of a running pipeline: its stage under the current plan, the control path, and (step/loop.py) the step loop.

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
schedule (no flush) each microbatch is its own update (see step/weight_stash.py).
"""
from __future__ import annotations

import gc
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.allocator import return_freed_memory
from model_parallel.codegen.boundary import StageBoundary
from model_parallel.codegen.build import build_stage
from model_parallel.errors import PeerError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, ControlChannel, NullChannel, StepReport
from model_parallel.runtime.build.materialize import Initializer, graph_constants, is_meta, materialize_layers, release_layers
from model_parallel.runtime.build.replicas import ReplicaGroups
from model_parallel.runtime.build.stages import check_plan_fits, layer_modules, stage_layers
from model_parallel.runtime.build.tied import SplitTie, TiedCopies
from model_parallel.runtime.checkpoint import resume
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.observe.memory_probe import NO_METER, StashMeter
from model_parallel.runtime.observe.straggler import Slowdown
from model_parallel.runtime.plancheck import check_plan
from model_parallel.runtime.step.executor import StepData, StepExecutor
from model_parallel.runtime.step.update import build_optimizer
from model_parallel.runtime.step.weight_stash import WeightStash
from model_parallel.runtime.step.loop import StepResult, TrainingLoop
from model_parallel.runtime.step.multi_stage import build_stages
from model_parallel.runtime.step.output import model_output
from model_parallel.runtime.step.reads import StepReader
from model_parallel.runtime.step.auto import run_order_times
from model_parallel.runtime.step.interleaved import run_schedule
from model_parallel.runtime.step.list_order import timed_schedule
from model_parallel.runtime.step.schedule import Schedule
from model_parallel.runtime.wire import comm
from model_parallel.runtime.wire.agreement import check_same_job, data_digest, graph_digest
from model_parallel.runtime.wire.loop_priority import lower_loop_threads

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
# Per-step results kept in memory (a long run would otherwise grow by every step; the metrics JSONL
# on disk keeps them all).
HISTORY_WINDOW = 1000


@dataclass
class Prepared:
    """A rank's stage under one plan, built but not yet live (`PipelineEngine.prepare` -> `install`)."""

    plan: Plan
    boundaries: tuple[StageBoundary, ...]
    ties: tuple[SplitTie, ...]
    stage_id: Optional[int]  # None: a spare under this plan; the first of `stage_ids`
    schedule: Schedule
    stage: Any = None  # the stage module; several stages (interleaved): their multi_stage.StageGroup
    optimizer: Optional[torch.optim.Optimizer] = None
    executor: Any = None  # StepExecutor, or MultiStageExecutor for several stages
    stage_ids: tuple[int, ...] = ()  # every stage this rank holds (several: interleaved 1F1B, loop placement)
    replica: int = 0
    num_replicas: int = 1


class PipelineEngine(TrainingLoop):
    """A rank's view of the pipeline. Build it after `init_process_group`, on every rank, with the same
    graph, plan, seed-built model and config; then call `train(steps)` on all ranks. It satisfies
    `migration.MigratingEngine`; `train` and `train_step` are the loop's (`step/loop.TrainingLoop`)."""

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
        # The data's fingerprints (0: none, or unreadable here), read before a prefetch thread reads: check_job.
        from model_parallel.runtime.checkpoint.data_identity import data_content
        self.data_hash, self.eval_data_hash = (data_digest(data_content(d) if d is not None else None)
                                               for d in (dataset, eval_dataset))
        self.channel = channel or NullChannel()
        self.health = health
        self.device = device or torch.device("cpu")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
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
        self.replica_groups = ReplicaGroups(self.device, options.timeout)
        # Boundary headers (shapes/dtypes) are sent once per (peer, tag) and then only on change.
        self.header_cache = comm.HeaderCache()
        self.pending_migration_s = 0.0
        self.step_pause_ms = 0.0
        self.switch_pauses_ms: deque[float] = deque(maxlen=HISTORY_WINDOW)  # the latest switches' pauses
        self.updates = 0  # optimizer updates after a flush applied by this rank (PipeDream: see WeightStash)
        self.history: deque[StepResult] = deque(maxlen=HISTORY_WINDOW)  # the latest steps' results
        self.next_step = 0  # the first step not yet run (after `train`: how far it got)
        self.start_step = 0  # the step `train` started from (after a resume: the checkpoint's next step)
        self.stop_reason: Optional[str] = None  # why `train` ended before its requested steps (a stop command or signal)
        self.stop_requests = 0  # ranks a signal asked to stop, per the last step's reduction (runtime/step/stop_signals.py)
        self.command: Optional[Command] = None  # the command of the last step's reduction, until `control` hands it out
        self._checkpointed_step: Optional[int] = None  # the step of the last checkpoint this run committed
        self.reader = StepReader(self.device, graph.metadata.get("inputs") or (), config.num_microbatches,
                                 fixed_sizes=graph.metadata.get("route") == "export")
        self.stage: Any = None
        self.stage_ids: tuple[int, ...] = ()
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.executor: Optional[StepExecutor] = None
        self.meter = StashMeter(self.device) if options.measure_memory else NO_METER
        try:  # the first collectives: the control group (within --timeout; torch's gloo default is 30 min), the job check
            self.control_group = control_group if control_group is not None else comm.new_group(self.timeout)
            self.activate(plan)
        except PeerError as error:  # a rank (the store host too) left after joining the world, or stalled: name it
            raise self.diagnose(error) from None
        except (MemoryError, RuntimeError) as error:  # materializing the stage: its weights did not fit
            self.raise_if_out_of_memory(error, next(iter(plan.with_default_ranks().stages_of_rank(self.rank)), None))
            raise

    @property
    def prefix(self) -> str:
        return f"[rank {self.rank} stage {','.join(map(str, self.stage_ids)) or '-'}]"

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
    def activate(self, plan: Plan, optimizer_state: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
        """Build this rank's stage and optimizer for `plan` (collective: every rank calls it together)."""
        plan = plan.with_default_ranks()
        self.check_job(plan)
        self.install(self.prepare(plan, optimizer_state))

    def check_job(self, plan: Plan) -> None:
        """Collective: `plan` fits the world and every rank holds the same graph, plan and config."""
        check_plan_fits(plan, self.world_size)
        check_same_job(self.graph_hash, plan, self.config, self.control_group, self.timeout,
                       run_order_times(self.graph, plan, self.config), self.data_hash, self.eval_data_hash)

    def prepare(self, plan: Plan, optimizer_state: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Prepared:
        """This rank's stage, optimizer and executor for `plan` (ranks assigned), built beside the running ones:
        local, and nothing live changes (the layers it shares with the running stage are the same objects,
        unmodified); `install` makes it live. A switch that fails here is rolled back (wire/migration.py)."""
        # On every rank alike, before anything changes; the coordinator runs the same check (runtime.plancheck).
        checked = check_plan(self.graph, plan, self.world_size, self.config.schedule, self.modules)
        held = plan.stages_of_rank(self.rank)
        # The schedule's grid; zero bubble's in an order list-built from the stage times where it is faster (list_order.py)
        schedule = run_schedule(self.config.schedule, plan.num_stages, self.config.num_microbatches,
                                plan.loop_width or plan.v_width or plan.num_ranks)
        schedule = timed_schedule(schedule, run_order_times(self.graph, plan, self.config))
        prepared = Prepared(plan, checked.boundaries, checked.ties, held[0] if held else None, schedule, stage_ids=held)
        if prepared.schedule.placement is not None and held:
            build_stages(self, prepared, optimizer_state)  # several stages on this rank (step/multi_stage.py)
        elif prepared.stage_id is not None:
            self._build_stage(prepared, optimizer_state)
        return prepared

    def install(self, prepared: Prepared) -> None:
        """Make a prepared stage live and drop the old one (collective: replica and tie groups, the tie check)."""
        plan = prepared.plan
        self.plan, self.boundaries, self.schedule, self.stage_id = plan, prepared.boundaries, prepared.schedule, prepared.stage_id
        self.header_cache.clear()  # every rank together, with nothing in flight: both ends agree
        self.replica_groups.create_for(plan)
        self.stage, self.optimizer, self.executor, self.stage_ids = (prepared.stage, prepared.optimizer, prepared.executor,
                                                                    prepared.stage_ids)
        self.replica, self.num_replicas = prepared.replica, prepared.num_replicas
        keep = {name for k in self.stage_ids for name in stage_layers(self.graph, plan, k)}
        left = sorted(self.lazy_layers - keep)
        release_layers(self.modules, left)  # layers that left this rank (the old stage is dropped: no one reads them)
        if left:  # their values, gradients and optimizer state are gone: give the memory back to the OS
            gc.collect()
            return_freed_memory()
        # A tie split across stages: its holders form a group (created on every rank, in the same order).
        self.tied = TiedCopies(prepared.ties, self.rank, self.stage_ids, self.stage, self.replica_groups.group)
        self.check_tied(f"when plan v{plan.version} was activated")
        lower_loop_threads(self.options.gloo_loop_nice)  # the groups made so far, this plan's included
        self.metrics.set_context(self.stage_id, plan.version, self.stage_ids)  # and its tracer's

    def stage_module(self, plan: Plan, boundaries: tuple[StageBoundary, ...], stage_id: int) -> Any:
        """Stage `stage_id`'s module, its layers materialized on this rank."""
        materialize_layers(self.modules, stage_layers(self.graph, plan, stage_id), self.initializer, self.device,
                           self.graph, graph_constants(self.graph, self.modules))
        stage = build_stage(self.graph, plan.stages[stage_id].node_ids, boundaries[stage_id], modules=self.modules,
                            class_name=f"Stage{stage_id}").to(self.device)
        stage.train()
        return stage

    def make_optimizer(self, prepared: Prepared, optimizer_state: Optional[Mapping[str, Mapping[str, Any]]]) -> None:
        """One optimizer over the parameters of `prepared.stage` (all of the rank's stages), state restored by name."""
        stage = prepared.stage
        if params := list(stage.parameters()):
            prepared.optimizer = build_optimizer(self.optimizer_factory, list(stage.named_parameters()))
            if self.options.offload_optimizer:  # the state lives in files from now on (runtime/step/offload.py)
                from model_parallel.runtime.step.offload import attach

                attach(prepared.optimizer, os.path.join(self.options.offload_optimizer, f"rank{self.rank}"),
                                 int(self.options.offload_chunk_bytes or 0))
            if optimizer_state:
                from model_parallel.runtime.checkpoint.store import load_optimizer_state_by_name

                load_optimizer_state_by_name(prepared.optimizer, dict(stage.named_parameters()), optimizer_state, copy=False)

    def make_executor(self, prepared: Prepared, stage: Any, stage_id: int, actions: Any, **extra: Any) -> StepExecutor:
        """The executor running `actions` of stage `stage_id` (this rank's routing, config, metrics, timeout)."""
        names = stage.output_names
        return StepExecutor(
            stage=stage, stage_id=stage_id, num_stages=prepared.plan.num_stages, actions=actions, route=self.rank_of,
            config=self.config, criterion=self.criterion, decode=lambda outputs: model_output(self.graph, names, outputs),
            device=self.device, header_cache=self.header_cache, metrics=self.metrics, timeout=self.timeout,
            flush=prepared.schedule.flush, **extra)

    def _build_stage(self, prepared: Prepared, optimizer_state: Optional[Mapping[str, Mapping[str, Any]]]) -> None:
        assert prepared.stage_id is not None
        stage_id, schedule = prepared.stage_id, prepared.schedule
        sp = prepared.plan.stages[stage_id]
        prepared.replica, prepared.num_replicas = sp.ranks.index(self.rank), sp.num_replicas
        stage = prepared.stage = self.stage_module(prepared.plan, prepared.boundaries, stage_id)
        self.make_optimizer(prepared, optimizer_state)
        stash = None
        if not schedule.flush and prepared.optimizer is not None:
            stash = WeightStash(stage, prepared.optimizer, self.config.lr_schedule, self.metrics, HISTORY_WINDOW)
        prepared.executor = self.make_executor(prepared, stage, stage_id,
                                           schedule.rank_actions(stage_id, prepared.replica, prepared.num_replicas),
                                           weight_stash=stash)
        prepared.executor.meter = self.meter

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
    def step_data(self, step: int, dataset: Any = None) -> StepData:
        """What this rank reads of minibatch `step` of `dataset` (default: the training data; step/reads.py)."""
        return self.reader.read(dataset or self.dataset, step, 0 in self.stage_ids,
                                self.plan.num_stages - 1 in self.stage_ids)  # several stages per rank: either, or both

    def diagnose(self, error: PeerError) -> PeerError:
        """`error` with this rank's prefix and, when heartbeats run, the peer that died (an error diagnosed
        already, by the tie check inside the first activation, is returned as it is)."""
        if getattr(error, "diagnosed", False):
            return error
        found = PeerError(f"{self.prefix} {error if self.health is None else self.health.diagnose(error)}")
        found.diagnosed = True  # type: ignore[attr-defined]
        return found

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
            from model_parallel.runtime.wire.migration import apply_switch

            try:  # a refused or rolled-back switch leaves every rank on its plan; only a dead peer ends the run
                self.pending_migration_s += apply_switch(self, command)
            except PeerError as error:
                raise self.diagnose(error) from None
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
        from model_parallel.runtime.checkpoint.training_record import describe_groups, probe_optimizer, training_record

        return training_record(self.config, self.dataset, next_step, probe_optimizer(self.optimizer, self.optimizer_factory),
                               describe_groups(self.optimizer_factory), self.graph, self.criterion)

    def load_checkpoint(self) -> int:
        """Restore this rank's stage from the latest checkpoint (any partition); returns the next step."""
        return resume.restore(self)

    def barrier(self) -> None:
        try:
            flag = torch.zeros(1)
            comm.wait_work(dist.all_reduce(flag, group=self.control_group, async_op=True), self.timeout, -1, "barrier")
        except PeerError as error:
            raise self.diagnose(error) from None

    def release_groups(self) -> None:
        """Drop the process groups this engine holds (`PipelineTrainer.close`): gloo has no shutdown, so a group
        lives while anything refers to it; without this torch's `destroy_process_group` frees none of ours and
        their threads are torn down in interpreter teardown, in whatever order that takes. The engine trains no more
        (deleted, not emptied: a step without its tie group would train silently wrong; this way it cannot start)."""
        del self.control_group, self.replica_groups, self.tied

    def raise_if_out_of_memory(self, error: BaseException, stage_id: Optional[int]) -> None:
        """An allocation refused becomes one line (`memory_probe.out_of_memory`), published as this rank's
        failure first: its peers then name it and why, not a flag mismatch. Other errors pass."""
        from model_parallel.runtime.observe.memory_probe import out_of_memory

        oom = out_of_memory(error, self.rank, stage_id, self.stage, self.optimizer, self.device)
        if oom is None:
            return
        if self.health is not None:
            self.health.stop("failed", None, str(oom))
        raise oom from None
