"""A rank holding several stages (interleaved 1F1B, loop placement): one module over them and one executor.

`StageGroup` is the module the engine, the loop and checkpoints see: the stages' layers (and any
parameters or buffers of their own) under the names the stages give them, so its state dict is keyed
by layer exactly as one stage's is, and one optimizer covers every stage of the rank.
`MultiStageExecutor` runs the rank's row of the schedule (`Schedule.row_actions`) action by action on
one `StepExecutor` per stage; each stage edge has its own message tags (comm.edge_tag), and each
executor pre-posts its edge's next receive, so two edges between the same two ranks never mix.
`build_stages` builds both for the engine (`prepare`), with one optimizer over every stage's parameters.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.errors import ConfigError, ModelParallelError
from model_parallel.runtime.observe.memory_probe import NO_METER
from model_parallel.runtime.observe.straggler import Compute
from model_parallel.runtime.step.executor import StepData, StepExecutor
from model_parallel.runtime.step.schedule import Action
from model_parallel.runtime.wire.local import Mailbox


def check_supported(backend: str) -> None:
    """Refuse what several stages per rank cannot honour yet (ConfigError naming the fix)."""
    if backend == "nccl":  # NCCL ignores tags (pytorch/pytorch#125079): two edges between one pair of ranks would mix
        raise ConfigError("the interleaved schedule needs a message tag per stage edge, which NCCL ignores: two edges "
                          "between the same ranks would exchange each other's values; run it with --backend gloo")


class LaneMeter:
    """One stage's view of its rank's `memory_probe.StashMeter` (--measure_memory): microbatch j of stage k is
    counted as k * m + j, so the (stage, microbatch) pairs a rank holds at once add up in one meter."""

    def __init__(self, meter: Any, stage: int, num_microbatches: int) -> None:
        self.meter, self.offset = meter, stage * num_microbatches

    def begin(self, microbatch: int) -> None:
        self.meter.begin(self.offset + microbatch)

    def kept(self, microbatch: int, entry: Any) -> None:
        self.meter.kept(self.offset + microbatch, entry)

    def keep(self, microbatch: int, tensors: Any) -> None:
        self.meter.keep(self.offset + microbatch, tensors)

    def release(self, microbatch: int) -> None:
        self.meter.release(self.offset + microbatch)


class StageGroup(nn.Module):
    """The union of several stage modules' members under their own names (not callable: run the stages)."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        # The stage modules themselves, kept out of the module tree (their members are this group's, by name): a
        # stage's own `training` decides its traced dropout, DropPath and BatchNorm (codegen/modes.py), so `eval()`
        # and `train()` must reach it, not only the layers; before, `evaluate` on several stages per rank dropped out.
        self._stages: tuple[nn.Module, ...] = tuple(stages)
        for stage in stages:
            for name, module in stage._modules.items():
                if self._new(name, module):
                    self.add_module(name, module)
            for name, param in stage._parameters.items():
                if self._new(name, param):
                    self.register_parameter(name, param)
            for name, buffer in stage._buffers.items():
                if self._new(name, buffer):
                    self.register_buffer(name, buffer, persistent=name not in stage._non_persistent_buffers_set)

    def _new(self, name: str, value: Any) -> bool:
        """Whether `name` is not held yet; the same object under it again is fine, another one is refused."""
        held = self._modules.get(name, self._parameters.get(name, self._buffers.get(name)))
        if held is None and name not in self._modules and name not in self._parameters and name not in self._buffers:
            return True
        if held is not value:  # check_shared_modules refuses this before the build
            raise ModelParallelError(f"two stages of this rank hold different members named {name!r}")
        return False

    def train(self, mode: bool = True) -> "StageGroup":
        super().train(mode)
        for stage in self._stages:
            stage.train(mode)
        return self

    def forward(self, *args: Any) -> Any:
        raise ModelParallelError("a rank's group of stages is not one computation: run its stages (multi_stage.py)")


class MultiStageExecutor:
    """Runs one rank's schedule row over the executors of its stages (`lanes`, by stage id)."""

    def __init__(self, lanes: Mapping[int, StepExecutor], actions: Sequence[Action], meter: Any = None,
                 num_microbatches: int = 0) -> None:
        """`meter`: the rank's StashMeter (--measure_memory), which each lane counts into (`LaneMeter`)."""
        self.lanes = dict(sorted(lanes.items()))
        for k, lane in self.lanes.items() if meter is not None else ():
            lane.meter = LaneMeter(meter, k, num_microbatches)
        self.actions = tuple(actions)
        unknown = sorted({a.stage for a in self.actions} - set(self.lanes))
        if unknown:
            raise ModelParallelError(f"the schedule row names stage(s) {unknown} this rank does not hold "
                                     f"({sorted(self.lanes)})")

    def run(self, step: int, data: StepData, compute: Compute, started: Optional[Callable[[], None]] = None) -> float:
        """The row's actions, in order, each on its stage's executor; returns this rank's share of the loss.
        `started` runs once, when every stage's first receives are posted."""
        states = {k: lane.begin(data) for k, lane in self.lanes.items()}
        if started is not None:
            started()
        for action in self.actions:
            self.lanes[action.stage].act(step, states[action.stage], action, compute)
        return sum(lane.finish(states[k]) for k, lane in self.lanes.items())

    def run_forward(self, data: StepData,
                    metric: Optional[Callable[[Any, torch.Tensor], Any]] = None) -> tuple[float, float]:
        """Forward-only (validation): the stages in increasing order, each over all its microbatches. Sends are
        non-blocking and a stage needs only the one before it, so every rank reaches each stage's inputs."""
        loss = metric_sum = 0.0
        for lane in self.lanes.values():
            part = lane.run_forward(data, metric)
            loss, metric_sum = loss + part[0], metric_sum + part[1]
        return loss, metric_sum


class BuildingEngine(Protocol):
    """What `build_stages` needs of the engine (`runtime/engine.PipelineEngine`): its rank, config and meter, and
    how it builds one stage's module, the optimizer and one stage's executor."""

    rank: int
    config: Any  # TrainConfig
    meter: Any  # memory_probe.StashMeter, or NO_METER

    def stage_module(self, plan: Any, boundaries: Any, stage_id: int) -> Any: ...

    def make_optimizer(self, prepared: Any, optimizer_state: Optional[Mapping[str, Mapping[str, Any]]]) -> None: ...

    def make_executor(self, prepared: Any, stage: Any, stage_id: int, actions: Any, **extra: Any) -> StepExecutor: ...


def build_stages(engine: BuildingEngine, prepared: Any, optimizer_state: Optional[Mapping[str, Mapping[str, Any]]]) -> None:
    """Several stages on this rank (interleaved 1F1B, ZB loop/V), into `prepared` (engine.Prepared): their modules,
    ONE optimizer over all their parameters (one update per step, as one process would), one executor running the
    rank's schedule row."""
    check_supported(backend=dist.get_backend())
    schedule = prepared.schedule
    # Replica i of the pipeline (ranks i*p ..) runs microbatches j % r == i in the full grid's order (no deadlock).
    ranks = prepared.plan.stages[prepared.stage_ids[0]].ranks
    replica, r = prepared.replica, prepared.num_replicas = ranks.index(engine.rank), len(ranks)
    stages = {k: engine.stage_module(prepared.plan, prepared.boundaries, k) for k in prepared.stage_ids}
    prepared.stage = StageGroup(list(stages.values()))
    engine.make_optimizer(prepared, optimizer_state)
    # ZBV: stage p-1 hands to stage p on this rank without a message, rounded as a message would be (bf16)
    mailbox = Mailbox(engine.rank, engine.config.wire_dtype)
    lanes = {k: engine.make_executor(prepared, stage, k, schedule.rank_actions(k, replica, r), tag_per_edge=True,
                                     local=mailbox)
             for k, stage in stages.items()}
    row = schedule.row_actions(schedule.row_of(prepared.stage_ids[0]))
    prepared.executor = MultiStageExecutor(lanes, [a for a in row if a.microbatch % r == replica],
                                           None if engine.meter is NO_METER else engine.meter,
                                           engine.config.num_microbatches)
