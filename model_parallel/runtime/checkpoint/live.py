"""A rank's stage state at a step boundary, taken from its engine when a peer is lost (`--recover`), and written
as a checkpoint shard and commit once the survivors agree every stage has a copy (cli/recover_sources.py).

The state is what this rank's checkpoint shard would hold (`commit.shard_state`): parameters, buffers and
optimizer state by stage-module name, plus what the manifest records (the world and plan it came from, the
fingerprint, the training record at the next step). It is exact only at a step boundary, so `StepTracker`
follows the engine: the step in progress and whether its update was applied, the last step done, a plan switch
under way. A failure inside a step before its update leaves the state of the step before; after the update,
the state of that step; during a plan switch, no usable state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from model_parallel.runtime.checkpoint.commit import CheckpointingEngine, commit_step, manifest_fields, shard_state
from model_parallel.runtime.checkpoint.store import save_shard


class LiveEngine(CheckpointingEngine, Protocol):
    """What taking a live state needs of a rank's engine, beyond what writing a checkpoint does."""

    stage_ids: tuple[int, ...]
    updates: int  # optimizer updates applied after a flush
    schedule: Any  # its `flush`: one update per step (else every microbatch updates: no step boundary state)
    train_step: Callable[[int], Any]
    apply: Callable[[Any], bool]


@dataclass
class StepTracker:
    """Where an engine stands between steps (wraps its `train_step` and `apply`; one tracker per engine)."""

    in_step: Optional[int] = None  # the step being run
    updates_at_start: int = 0  # the engine's `updates` when it began
    done: Optional[int] = None  # the last step completed (None: none yet in this engine)
    switching: bool = False  # a command (a plan switch) is being applied

    def watch(self, engine: LiveEngine) -> None:
        step_fn, apply_fn = engine.train_step, engine.apply

        def train_step(step: int) -> Any:
            self.in_step, self.updates_at_start = step, engine.updates
            result = step_fn(step)
            self.in_step, self.done = None, step
            return result

        def apply(command: Any) -> bool:
            self.switching = True
            result = apply_fn(command)
            self.switching = False
            return result

        engine.train_step, engine.apply = train_step, apply

    def state_step(self, engine: LiveEngine) -> tuple[Optional[int], str]:
        """(the last step whose update the engine's state holds, "") or (None, why it holds no step's state)."""
        if not engine.schedule.flush:
            return None, "the pipedream schedule updates after every microbatch: no state belongs to one step"
        if self.switching:
            return None, "a plan switch was under way"
        if self.in_step is not None:  # inside a step: before its update, the state of the step before
            return (self.in_step - 1 if engine.updates == self.updates_at_start else self.in_step), ""
        if self.done is None:
            return None, "the failure came before its first step (while building or restoring)"
        return self.done, ""


@dataclass
class StageState:
    """One rank's live stage state at a step boundary, on the CPU (what its checkpoint shard would hold)."""

    step: int  # the last step whose update it holds
    rank: int  # the rank in the world it came from (its shard is named after it)
    stage_ids: tuple[int, ...]  # the stages it holds (empty: a spare)
    plan_version: int
    stage_ranks: tuple[tuple[int, ...], ...]  # that world's plan: the ranks of each stage
    params: dict[str, Any] = field(repr=False)
    buffers: dict[str, Any] = field(repr=False)
    optimizer: dict[str, Any] = field(repr=False)
    fields: dict[str, Any] = field(repr=False)  # the manifest's world, fingerprint and extra (commit.manifest_fields)
    graph: Any = field(repr=False)  # for the checkpoint's model files
    model: Any = field(repr=False)

    def summary(self) -> dict[str, Any]:
        """What the other survivors learn of it (JSON)."""
        return {"step": self.step, "rank": self.rank, "stages": list(self.stage_ids), "version": self.plan_version,
                "stage_ranks": [list(r) for r in self.stage_ranks]}


def capture(engine: LiveEngine, tracker: StepTracker) -> tuple[Optional[StageState], str]:
    """The engine's stage state (CPU), or (None, why there is none). Call before the engine is dropped."""
    step, why = tracker.state_step(engine)
    if step is None:
        return None, why
    if step < 0:
        return None, "no step had been completed"
    if engine.stage is not None:
        # `.cpu()` copies a device tensor; a CPU tensor is kept, not cloned: the failed engine is dropped
        # right after, so nothing changes it, and a clone would hold the stage twice.
        params, buffers, opt = (dict(part) for part in shard_state(engine, engine.stage))
        params = {k: v.detach().cpu() for k, v in params.items()}
        buffers = {k: v.detach().cpu() for k, v in buffers.items()}
    else:
        params, buffers, opt = {}, {}, {}
    plan = engine.plan.with_default_ranks()
    return StageState(step, engine.rank, tuple(engine.stage_ids), plan.version,
                      tuple(tuple(s.ranks) for s in plan.stages), params, buffers, opt,
                      manifest_fields(engine, step), engine.graph, engine.model), ""


def write_shard(directory: str, state: StageState) -> None:
    """This rank's shard of checkpoint `state.step` (named after its rank in the world it came from)."""
    save_shard(directory, state.step, state.rank, state.params, state.buffers, state.optimizer)


def commit(directory: str, state: StageState, writers: list[int]) -> None:
    """Commit checkpoint `state.step` once the `writers` (ranks of the world it came from) wrote their shards."""
    commit_step(directory, state.step, state.graph, state.model, state.fields, writers)
