"""A rank's stage state at a step boundary, taken from its engine when a peer is lost (`--recover`), and written
as a checkpoint shard and commit once the survivors agree every stage has a copy (cli/recover_sources.py).

The state is what this rank's checkpoint shard would hold (`commit.shard_state`): parameters, buffers and
optimizer state by stage-module name, plus what the manifest records (the world and plan it came from, the
fingerprint, the training record at the next step). It is exact only at a step boundary, so `StepTracker`
follows the engine: the step in progress and whether its update was applied, the last step done, a plan switch
under way. A failure inside a step before its update leaves the state of the step before; after the update,
the state of that step; during a plan switch, no usable state.

`--redundancy 1` also snapshots the state every K steps (`take(..., clone=True)`: training goes on) and sends
it to another rank: `encode`/`decode` turn a state into bytes and back (a JSON header and raw tensor bytes;
nothing pickled, dtypes from a closed list, the header's JSON bounded).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from model_parallel import jsonbound
from model_parallel.errors import CheckpointError
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

    def nbytes(self) -> int:
        tensors = [*self.params.values(), *self.buffers.values(),
                   *(v for entry in self.optimizer.values() for v in entry.values() if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

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
    # `.cpu()` copies a device tensor; a CPU tensor is kept, not cloned: the failed engine is dropped right
    # after, so nothing changes it, and a clone would hold the stage twice.
    return take(engine, step, clone=False), ""


def take(engine: LiveEngine, step: int, clone: bool) -> StageState:
    """The engine's stage state after step `step`, on the CPU (`clone`: copied, for an engine that trains on)."""
    if engine.stage is not None:
        params, buffers, opt = (dict(part) for part in shard_state(engine, engine.stage))  # optimizer state: copied
        params = {k: _cpu(v, clone) for k, v in params.items()}
        buffers = {k: _cpu(v, clone) for k, v in buffers.items()}
    else:
        params, buffers, opt = {}, {}, {}
    plan = engine.plan.with_default_ranks()
    return StageState(step, engine.rank, tuple(engine.stage_ids), plan.version,
                      tuple(tuple(s.ranks) for s in plan.stages), params, buffers, opt, manifest_fields(engine, step))


def _cpu(tensor: torch.Tensor, clone: bool) -> torch.Tensor:
    out = tensor.detach().cpu()
    return out.clone() if clone and out.data_ptr() == tensor.data_ptr() else out


def write_shard(directory: str, state: StageState) -> None:
    """This rank's shard of checkpoint `state.step` (named after its rank in the world it came from)."""
    save_shard(directory, state.step, state.rank, state.params, state.buffers, state.optimizer)


def commit(directory: str, state: StageState, writers: list[int], graph: Any, model: Any) -> None:
    """Commit checkpoint `state.step` once the `writers` (ranks of the world it came from) wrote their shards."""
    commit_step(directory, state.step, graph, model, state.fields, writers)


# ----------------------------------------------------------------------------- bytes (--redundancy)

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                                      torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                      torch.bool)}
_HEADER = struct.Struct("<Q")


def encode(state: StageState) -> bytes:
    """A JSON header (what the state is, where each tensor's bytes lie) followed by the raw bytes."""
    tensors: list[list[Any]] = []
    chunks: list[bytes] = []
    offset = 0
    opt_scalars: dict[str, dict[str, Any]] = {}

    def add(path: list[str], tensor: torch.Tensor) -> None:
        nonlocal offset
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        tensors.append([path, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, len(data)])
        chunks.append(data)
        offset += len(data)

    for section, values in (("params", state.params), ("buffers", state.buffers)):
        for name, tensor in values.items():
            add([section, name], tensor)
    for name, entry in state.optimizer.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                add(["optimizer", name, key], value)
            else:
                opt_scalars.setdefault(name, {})[key] = value
    header = json.dumps({"step": state.step, "rank": state.rank, "stage_ids": list(state.stage_ids),
                         "version": state.plan_version, "stage_ranks": [list(r) for r in state.stage_ranks],
                         "fields": state.fields, "tensors": tensors, "scalars": opt_scalars}).encode()
    return _HEADER.pack(len(header)) + header + b"".join(chunks)


def decode(data: bytes, where: str) -> StageState:
    """The state `encode` wrote; CheckpointError naming `where` for anything malformed."""
    if len(data) < _HEADER.size:
        raise CheckpointError(f"{where}: {len(data)} bytes is no stage state")
    (length,) = _HEADER.unpack_from(data)
    body = memoryview(data)[_HEADER.size + length:]
    head = jsonbound.loads(bytes(data[_HEADER.size:_HEADER.size + length]), where=where, error=CheckpointError)
    try:
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        optimizer: dict[str, dict[str, Any]] = {name: dict(v) for name, v in head["scalars"].items()}
        for path, dtype, shape, offset, size in head["tensors"]:
            if not (isinstance(path, list) and len(path) == (3 if path[:1] == ["optimizer"] else 2)
                    and path[0] in ("params", "buffers", "optimizer")):
                raise CheckpointError(f"{where}: tensor path {str(path)[:80]} is not [params|buffers, name] or "
                                      "[optimizer, name, key]")
            if dtype not in _DTYPES or offset < 0 or size < 0 or offset + size > len(body):
                raise CheckpointError(f"{where}: tensor {path} ({dtype}, bytes {offset}..{offset + size}) is malformed")
            raw = torch.frombuffer(bytearray(body[offset:offset + size]), dtype=torch.uint8)
            tensor = raw.view(_DTYPES[dtype]).reshape([int(d) for d in shape])
            if path[0] == "optimizer":
                optimizer.setdefault(str(path[1]), {})[str(path[2])] = tensor
            else:
                (params if path[0] == "params" else buffers)[str(path[1])] = tensor
        return StageState(int(head["step"]), int(head["rank"]), tuple(int(k) for k in head["stage_ids"]),
                          int(head["version"]), tuple(tuple(int(r) for r in ranks) for ranks in head["stage_ranks"]),
                          params, buffers, optimizer, dict(head["fields"]))
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as error:
        raise CheckpointError(f"{where}: not a stage state ({type(error).__name__}: {error})") from None
