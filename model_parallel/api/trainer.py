"""The Python API: `PipelineTrainer(model, optimizer_factory, dataset, TrainConfig(...)).train(steps)`.

    import torch, torch.distributed as dist
    from model_parallel import PipelineTrainer, TrainConfig
    with torch.device("meta"):                             # no memory: each rank allocates its own stage
        model = MyModel()                                  # (a model with real values works too, and keeps them)
    trainer = PipelineTrainer(model, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                              dataset, TrainConfig(batch_size=32, num_microbatches=4), num_stages=2)
    trainer.train(100)
    trainer.close()                                        # or `with PipelineTrainer(...) as trainer:`

Run it under `torchrun --nproc_per_node=2 my_script.py` (one stage per rank), or without a process
group for single-process mode (all stages in this process, for debugging). `dataset` is a map-style
`torch.utils.data.Dataset` (batched by `collate_fn`, default torch's), an iterable of samples, a `DataLoader`,
or anything with `batch(step) -> (inputs_tuple, target)` (`runtime.data.sources`, `runtime.data.batches`). The model, graph or package is
turned into a job by `api.job.build_job`, the same builder the worker command line uses.
"""
from __future__ import annotations

import atexit
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from model_parallel.api.auto_schedule import schedule_refusals
from model_parallel.api.job import JobSpec, build_job
from model_parallel.errors import ConfigError, DataError, ModelParallelError, PeerError, PlanError, TrainingStopped
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.engine import OptimizerFactory
from model_parallel.runtime.step.loop import StepResult
from model_parallel.runtime.trainer import SingleProcessRunner

logger = logging.getLogger(__name__)

__all__ = ["PipelineTrainer", "TrainConfig", "RunOptions"]


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
        criterion: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
        plan: Optional[Plan] = None,
        num_stages: Optional[int] = None,
        example_inputs: Optional[Sequence[Any]] = None,
        channel: Any = None,
        single_process: Optional[bool] = None,
        weights: Union[str, Path, None] = None,
        init_weights: Optional[Callable[[Any, str], None]] = None,
        collate_fn: Optional[Callable[[list[Any]], Any]] = None,
        eval_data: Any = None,
        memory_per_worker: Optional[float] = None,
    ) -> None:
        import torch.distributed as dist

        source = model_or_package_or_graph
        if not isinstance(source, (nn.Module, Graph, str, Path)):
            raise ModelParallelError(f"PipelineTrainer takes an nn.Module, a Graph or a package directory, "
                                     f"got {type(source).__name__}")
        # A causal LM trained with its own head's loss reads a dict batch's "labels" as the model would (shifted);
        # a criterion given receives them as they are.
        from model_parallel.api.hf_loss import shifts_labels

        self._causal_labels = criterion is None and shifts_labels(source)
        if criterion is None:  # a Hugging Face model's by its head, refused before profiling; else cross entropy
            from model_parallel.api.hf_loss import default_criterion

            criterion = default_criterion(source)
        distributed = dist.is_available() and dist.is_initialized()
        self.single_process = (not distributed) if single_process is None else single_process
        world = dist.get_world_size() if distributed and not self.single_process else 1
        if self.single_process and (ignored := [name for name in ("checkpoint_dir", "resume", "metrics", "trace_dir")
                                                if getattr(options, name)]):
            # It trains in memory and writes nothing: a checkpoint never written, a resume that starts at step 0.
            raise ConfigError(f"single-process mode (no process group, or single_process=True) does not honour "
                              f"RunOptions {', '.join(ignored)}: it checkpoints, resumes and writes metrics or traces "
                              f"only as a pipeline; run under torchrun (a stage per process), or leave them unset")
        if options.eval_every and eval_data is None:  # the command line refuses --eval_every without --eval_data too
            raise ConfigError(f"RunOptions(eval_every={options.eval_every}) validates on eval_data, and none was given: "
                              "pass eval_data=... (any form the training data takes), or leave eval_every at 0")
        spec = JobSpec(
            model=source if isinstance(source, nn.Module) else None,
            package=source if isinstance(source, (str, Path)) else None,
            graph=source if isinstance(source, Graph) else None,
            plan=plan, num_stages=num_stages or (2 if self.single_process else None), criterion=criterion,
            data=dataset, collate_fn=collate_fn, causal_labels=self._causal_labels, eval_data=eval_data, example_inputs=example_inputs, seed=config.seed,
            batch_size=config.batch_size, num_microbatches=config.num_microbatches, weights=weights,
            init_weights=init_weights, memory_per_worker=memory_per_worker, schedule=config.schedule,
            schedule_order=config.schedule_order,
            schedule_refusals=schedule_refusals(config, options.measure_memory,
                                                dist.get_backend() if distributed and not self.single_process else "gloo"),
            optimizer=_optimizer_kind(optimizer_factory) if memory_per_worker is not None else "sgd_momentum",
            offload_chunk=options.offload_chunk_bytes)
        job = build_job(spec, world)
        graph, plan, model = job.graph, job.plan, job.model
        control_group = None
        if world > 1:
            # Ranks may have profiled and partitioned on their own (timings differ per process):
            # everyone trains rank 0's plan, or stages would not line up. Sent on the engine's gloo control
            # group: an NCCL default group carries no CPU tensors ("No backend type associated with device type cpu").
            from model_parallel.graph.plan import plan_stage_times, with_stage_times
            from model_parallel.runtime.step.auto import run_order_times
            from model_parallel.runtime.wire.agreement import broadcast_json

            from model_parallel.runtime.wire.comm import new_group

            control_group = new_group(options.timeout, what="creating the control group")  # 30 minutes by default
            # Rank 0's stage times travel with its plan: a zero-bubble order list-built from each rank's own profile
            # would differ from rank to rank (the engine refuses that: wire/agreement.py).
            times = run_order_times(graph, plan, config.resolved(plan)) if plan_stage_times(plan) is None else None
            plan = plan if times is None else with_stage_times(plan, times)
            text = broadcast_json(json.dumps(plan.to_dict()), 0, control_group, options.timeout)
            plan = Plan.from_dict(json.loads(text), "the plan broadcast by rank 0")
        self.graph, self.plan, self.model = graph, plan.with_default_ranks(), model
        config = config.resolved(plan)  # schedule "auto": the one the builder chose (rank 0's, with its plan)
        self.config, self.collate_fn, self.options, self.eval_dataset = config, collate_fn, options, job.eval_dataset
        self._timeout, self._original = options.timeout, source if isinstance(source, nn.Module) else None
        self.health: Any = None
        self._closed = False  # close() let go of the process groups
        self._next_step: Optional[int] = None  # where the next `train` call starts (None: not trained yet)
        # The end-of-train memory table (`memory_report`): predicted for this optimizer, measured from here on.
        self.memory_report: Any = None
        self._optimizer_factory = optimizer_factory  # probed for the report only where no optimizer was built here
        self._probe: Any = None
        from model_parallel.runtime.build.tied import check_schedule

        check_schedule(graph, self.plan, config.schedule)  # before any runner or heartbeat starts
        if self.single_process:
            offload = (options.offload_optimizer, int(options.offload_chunk_bytes or 0)) if options.offload_optimizer else None
            self.runner: Any = SingleProcessRunner(graph, self.plan, model, job.criterion, optimizer_factory, job.dataset,
                                                   config, initializer=job.initializer, offload=offload)
        else:
            from model_parallel.runtime.engine import PipelineEngine
            from model_parallel.runtime.wire.health import Health

            # Heartbeats in the process group's own store, so a dead peer is named (see health.py).
            store = dist.distributed_c10d._get_default_store()
            device = torch.device("cpu")
            if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
                from model_parallel.runtime.build.materialize import move_real

                device = torch.device("cuda", torch.cuda.current_device())
                move_real(model, device)
            from model_parallel.runtime.observe.memory_probe import PeakProbe

            self._probe = PeakProbe(device)
            self._probe.start()  # before the stage is materialized: the peak counts everything the run adds
            self.health = Health(store, dist.get_rank(), dist.get_world_size(), interval=min(1.0, options.timeout / 10),
                                 store_host=None).start()
            # The heartbeat thread must be stopped before interpreter teardown: a store call still
            # running in it then aborts the process ("terminate called without an active exception").
            # atexit runs before the teardown (stop() is idempotent: close() may have run already).
            atexit.register(self.health.stop, "done")
            try:  # building the stage fails on this rank alone (a weight missing from the file, out of memory)
                self.runner = PipelineEngine(graph=graph, plan=self.plan, model=model, criterion=job.criterion,
                                             optimizer_factory=optimizer_factory, dataset=job.dataset, config=config,
                                             options=options, channel=channel, health=self.health, device=device,
                                             initializer=job.initializer, eval_dataset=job.eval_dataset,
                                             control_group=control_group)
            except Exception as error:
                self._publish_failure(error)
                raise

    def _publish_failure(self, error: BaseException) -> None:
        """This rank's error, published as its failure before the exit hook says "done": peers then name this rank
        and its error, not "rank(s) [r] already finished (same --steps and plan?)". A diagnosis published first
        stays (`Health.stop` publishes once)."""
        if self.health is not None:
            first = str(error).splitlines()[0][:300] if str(error) else ""
            self.health.stop("failed", None, f"{type(error).__name__}: {first}")

    def train(self, steps: int) -> list[StepResult]:
        """Train `steps` steps (all ranks call this together); returns this rank's results of those steps. The first
        call starts at step 0 (with `RunOptions(resume=True)`, at the checkpoint's next step, up to step `steps`); each
        later call continues where the last one ended, with the minibatches, lr schedule and dropout masks of the
        steps that follow (one call of the total equals the calls in a row). A stop command, or a signal after
        `runtime.step.stop_signals.install()`, ends it at a step boundary: TrainingStopped. A first call after a resume
        that the checkpoint had already reached trains nothing and says so (a loop of train(k) would run past its total:
        call train(0) first, which only resumes, then loop on `next_step`)."""
        self._check_open("train")
        if self.runner.dataset is None:
            raise DataError("PipelineTrainer was built without data (dataset=None), so it has nothing to train on: "
                            "pass a dataset (evaluate(data, steps) takes its own)")
        # Before, every call started at step 0 again: `for epoch ...: trainer.train(k)` retrained the first k
        # minibatches with the lr schedule restarted, without a word.
        start = self._next_step or 0
        end = start + steps if self._next_step is not None else steps
        if not self.single_process:
            if self._next_step is not None and self.options.resume:  # resumed once: a later call continues in memory
                self.runner.options = replace(self.runner.options, resume=False)
            try:
                first = self._next_step is None
                results = self.runner.train(end, start)
                self._next_step = self.runner.next_step  # where a stop command or signal ended it, if one did
                if first and steps and self.options.resume and self.runner.start_step >= end and self.runner.rank == 0:
                    _warn_nothing_resumed(self.runner.start_step, steps)
                if self.runner.stop_reason is not None:  # fewer steps than asked: never silently
                    raise TrainingStopped(f"{self.runner.prefix} stopped after {self.runner.next_step} of the {end} "
                                          f"requested step(s): {self.runner.stop_reason}")
            except TrainingStopped:
                raise
            except Exception as error:
                self._publish_failure(error)
                raise
            self._report_memory()
            return [result for result in results if result.step >= self.runner.start_step]  # not earlier calls'
        # Single-process mode validates as the pipeline's loop does: every eval_every steps and after the last.
        every, results = self.options.eval_every, []
        for step in range(start, end):
            results += self.runner.train(step + 1, step)
            self._next_step = step + 1
            if self.eval_dataset is not None and every and ((step + 1) % every == 0 or step + 1 == end):
                results[-1].extra["val_loss"] = self.runner.evaluate(self.eval_dataset, self.options.eval_steps).loss
                logger.info("[single process] step %d val_loss %.6f", step, results[-1].extra["val_loss"])
        self._report_memory()
        return results

    @property
    def next_step(self) -> int:
        """The step the next `train` call starts from (0 before any; after a resume, known once the first call ran)."""
        return self._next_step or 0

    def _report_memory(self) -> None:
        """Predicted vs measured peak per stage (`runtime/observe/memory_table.py`, the worker command line's table)
        into `self.memory_report`, logged on rank 0. Collective on several ranks. One process holds every stage
        in single-process mode, so there the table is the prediction alone (measured: n/a)."""
        from model_parallel.runtime.observe import memory_table

        kind = _report_kind(getattr(self.runner, "optimizer", None), self._optimizer_factory)
        if kind is None:
            return
        config = self.config
        parts = memory_table.predicted(self.graph, self.plan, kind, 0.0, config.schedule,
                                       config.num_microbatches, config.batch_size // config.num_microbatches,
                                       self.options.offload_chunk_bytes)
        if self.single_process:
            rows = [(str(stage), memory_table.Measured(stage)) for stage in range(self.plan.num_stages)]
            self.memory_report = memory_table.MemoryReport(
                parts, rows, memory_table.format_memory(parts, rows, "stage", "not measured: one process"))
        else:
            self.memory_report = memory_table.gather_report(self.runner, self._probe, parts, self.runner.device)
        if self.single_process or self.runner.rank == 0:
            logger.info("memory per stage, predicted vs measured:\n%s", self.memory_report.text)

    def evaluate(self, data: Any, steps: int, metric: Optional[Callable[[Any, torch.Tensor], Any]] = None,
                 collate_fn: Optional[Callable[[list[Any]], Any]] = None) -> Any:
        """Validate on `steps` minibatches of `data` (any form `dataset` takes; all ranks call this together):
        a forward-only pipeline, no backward or update. Returns `EvalResult(loss, metric, steps)`, the means over
        steps of each minibatch's mean over microbatches of `criterion` (and `metric(output, target)`)."""
        from model_parallel.runtime.data.sources import as_source

        self._check_open("evaluate")
        source = as_source(data, self.config.batch_size, self.config.seed, collate_fn or self.collate_fn,
                           self._causal_labels)
        return self.runner.evaluate(source, steps, metric)

    def close(self) -> None:
        """End this rank's communication (idempotent; the heartbeat also stops at exit): stop and join the
        heartbeat thread, which writes to the group's store, and let go of the process groups, so that
        `dist.destroy_process_group()`, called after it, frees them there and then. Until that call `state_dict`
        and `save_pretrained` still work (on the default group: the same ranks); training and validating refuse."""
        if self.health is not None:
            self.health.stop("done")
        if not self.single_process and not self._closed:
            self.runner.release_groups()
            self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"PipelineTrainer.{what}: this trainer was closed (close() ends its communication); "
                               "build a new PipelineTrainer to train or validate again")

    def __enter__(self) -> "PipelineTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self, original_names: bool = False) -> dict[str, torch.Tensor]:
        """This process's stage state (all stages in single-process mode) by stage-module name; with
        `original_names`, the whole model's in the original model's names (collective on several ranks),
        ready for `model.load_state_dict(state, strict=True)` (api/export.py). That gathers EVERY stage onto
        every rank: for a model bigger than one worker use `save_pretrained`, which never does."""
        local = self.runner.state_dict() if self.single_process else self.runner.named_state()
        if not original_names:
            return local
        from model_parallel.api.export import gather_state, original_state_dict

        if self.single_process:
            whole = local
        else:
            with _collective("state_dict(original_names=True)"):
                whole = gather_state(local, self._timeout)
        return original_state_dict(self.graph, whole, self._original)

    def save_pretrained(self, directory: Union[str, Path], max_shard_size: Union[int, str] = "5GB") -> Optional[Path]:
        """Write the trained Hugging Face model as `from_pretrained` reads it. On several ranks a collective in
        which each rank writes its own stage's shards and rank 0 the index and config (api/shard_export.py): no
        rank holds more than its stage. Returns the directory on rank 0 (and in single-process mode), None on
        the others."""
        import torch.distributed as dist

        from model_parallel.api.export import save_pretrained

        if self._original is None:
            raise ModelParallelError("save_pretrained needs the Hugging Face model itself; for a graph or package call "
                                     "api.export.save_pretrained(config, trainer.state_dict(original_names=True), dir)")
        if self.single_process:
            return save_pretrained(self._original, self.state_dict(original_names=True), directory,
                                   max_shard_size=max_shard_size)
        from model_parallel.api.shard_export import save_pretrained_sharded

        with _collective("save_pretrained"):
            out = save_pretrained_sharded(self._original, self.graph, self.runner.named_state(), directory,
                                          group=None if self._closed else self.runner.control_group,
                                          timeout=self._timeout, max_shard_size=max_shard_size)
        return out if dist.get_rank() == 0 else None


def _warn_nothing_resumed(resumed: int, steps: int) -> None:
    """The first `train(steps)` after a resume counts to step `steps` from 0 (a rerun of the same script ends where the
    run would have); later calls train `steps` more. A checkpoint at or past it leaves that call nothing to train, and a
    loop of `train(k)` calls, each then k more, went past its total without a word."""
    logger.warning("resumed at step %d, which train(%d) had already reached: this call trained nothing (the first call "
                   "after a resume trains up to step `steps` counted from 0, later calls `steps` more each); to train in "
                   "chunks after a resume, call train(0) first (it resumes and trains nothing), then loop `while "
                   "trainer.next_step < total: trainer.train(min(k, total - trainer.next_step))`", resumed, steps)


@contextmanager
def _collective(what: str) -> Iterator[None]:
    """A peer lost inside a collective call says that it is one: the usual cause is a call on some ranks only (on
    rank 0 alone, as one would write a file), and the peer's "Connection closed by peer" or timeout does not say so."""
    try:
        yield
    except PeerError as error:
        where = "" if str(error).startswith(what.split("(")[0]) else f"{what}: "
        raise type(error)(f"{where}{error} ({what} is collective: call it on every rank, together)") from error


def _report_kind(built: Optional[torch.optim.Optimizer], factory: OptimizerFactory) -> Optional[str]:
    """The optimizer kind the memory report prices: that of the optimizer this process built (the factory is called
    once more, on a probe, only on a spare rank that built none); None (no report, said once) for one the model
    does not know."""
    from model_parallel.optimizer.memory import optimizer_kind

    try:
        if built is None:
            return _optimizer_kind(factory)
        return optimizer_kind(type(built).__name__.lower(), float(built.defaults.get("momentum", 0.0) or 0.0))
    except (PlanError, TypeError, ValueError, AttributeError) as error:  # the report is not worth failing a run for
        logger.warning("no memory report at the end of train: the optimizer's state cannot be priced (%s: %s)",
                       type(error).__name__, error)
        return None


def _optimizer_kind(factory: OptimizerFactory) -> str:
    """Which optimizer state the memory model prices: the factory's optimizer, built on one probe tensor."""
    from model_parallel.optimizer.memory import optimizer_kind

    probe = factory([nn.Parameter(torch.zeros(1))])
    return optimizer_kind(type(probe).__name__.lower(), float(probe.defaults.get("momentum", 0.0) or 0.0))

