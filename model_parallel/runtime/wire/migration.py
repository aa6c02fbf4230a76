"""Switch a live pipeline to a new plan: move layers (parameters, buffers, optimizer state) between ranks.

Called by every rank at the same step boundary (the command rides in the step's one reduction,
wire/step_totals.py) with the same new plan; with a flush schedule nothing is in flight, so the switch is exact.

1. Who moves what: for every layer, its owners under the old plan (all replicas of its stage) and
   under the new one. Each new owner that did not hold the layer gets it from one old owner
   (the k-th new owner from old owner k mod n: replicas spread the sending). Every rank derives
   the same transfer list from the two plans; no negotiation.
2. One message per (source, destination) pair on `comm.TAG_MIGRATION`: a manifest (JSON) naming
   each value - `["state", "layer1_0_conv1.weight"]` for a parameter or buffer,
   `["opt", "layer1_0_conv1.weight", "momentum_buffer"]` for optimizer state - then the values
   (tensors, or JSON for scalars). Every rank first posts all its sends, then receives: no deadlock.
3. Received values are copied into this rank's layer objects (every rank holds every layer
   object; only owned ones are current; a layer on meta is first given storage, before any send
   is posted). Kept layers are the same objects, untouched.
4. `engine.prepare(new_plan, optimizer_state)` builds the new stage around those objects with
   `codegen.build_stage(..., modules=...)` and a new optimizer with its state keyed by parameter name
   (momentum, Adam moments, step counts), beside the running stage; `engine.install` then makes it
   live (collectively: replica groups, ties) and puts layers that left back on meta (freed).

Failures (issue 33 item 3). The running stage, its optimizer and every layer it holds stay untouched
until the switch commits, so a switch that fails on one rank can be undone on all of them. Each rank
runs its local parts - allocating the arriving layers (before any byte moves), storing what it
received, building the new stage - catching what they raise; after the allocation and again after
the build, one small all-gather (`agreement.agree`, with the timeout) tells every rank whether every
rank succeeded. If not, every rank drops what it built and what arrived, keeps its old plan, stage,
parameters and optimizer state (the very same objects, so bit-identical) and raises
`SwitchRolledBack` naming the failed rank(s) and the one-line causes; the engine logs it, rank 0 tells
the coordinator (`switch-failed`), and training goes on. What is not undone: a dead or silent peer
(a PeerError: the run ends naming it, as anywhere else) and a rank that cannot even allocate the
buffers a message arrives in (the message cannot be drained: that rank fails as out of memory).
Memory: until the commit a rank holds both its old stage and the arriving layers (as before this
design too), and now also the layers that leave while the new stage is built (docs/reliability.md).

Spares in either plan are handled the same way: a rank with no stage sends what it held and
receives nothing; a spare that becomes active receives all of its layers.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Optional, Protocol, Union

import torch
from torch import nn

from model_parallel.allocator import return_freed_memory
from model_parallel.errors import ConfigError, ModelParallelError, PeerError, SwitchRolledBack
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, ControlChannel
from model_parallel.runtime.build.materialize import allocate_layers, release_layers
from model_parallel.runtime.build.stages import layer_owners
from model_parallel.runtime.build.tied import expand_state
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.observe.tracing import Tracer
from model_parallel.runtime.checkpoint.state import StreamedState, optimizer_state_by_name
from model_parallel.runtime.step.offload import offload_of
from model_parallel.runtime.plancheck import check_plan, check_switchable
from model_parallel.runtime.wire import comm
from model_parallel.runtime.wire.agreement import agree

logger = logging.getLogger(__name__)

Transfer = tuple[int, int, str]  # (source rank, destination rank, layer name)


class MigratingEngine(Protocol):
    """What a plan switch needs of a rank's engine (`PipelineEngine` is one)."""

    graph: Graph
    plan: Plan  # the plan running now
    rank: int
    device: torch.device
    stage: Optional[nn.Module]  # this rank's stage under `plan`; None on a spare
    optimizer: Optional[torch.optim.Optimizer]
    control_group: Any  # a gloo group of every rank (the agreement on a switch's outcome)
    lazy_layers: set[str]  # layers built on meta: given storage when they arrive, released when they leave

    @property
    def modules(self) -> MutableMapping[str, Union[nn.Module, torch.Tensor]]:
        """Every layer object by layer name, owned or not (a module, or a bare parameter/buffer tensor);
        a switch gives arriving meta layers storage in place."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds any blocking communication may take."""
        ...

    def check_job(self, plan: Plan) -> None:
        """Collective: `plan` fits the world and every rank holds the same graph, plan and config."""
        ...

    def prepare(self, plan: Plan, optimizer_state: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Any:
        """This rank's stage and optimizer for `plan`, built beside the running ones (local; nothing live changes)."""
        ...

    def install(self, prepared: Any) -> None:
        """Make a prepared stage live and drop the old one (collective)."""
        ...


class SwitchingEngine(MigratingEngine, Protocol):
    """What acting on a switch command needs besides the switch itself (`PipelineEngine` is one)."""

    world_size: int
    config: TrainConfig
    channel: ControlChannel  # rank 0's: told of a refused or rolled-back switch when it can hear it
    tracer: Tracer
    switch_pauses_ms: deque[float]  # the pauses of the latest switches that went through (bounded)

    @property
    def prefix(self) -> str:
        """`[rank r stage s]`, for log lines."""
        ...


def plan_transfers(graph: Any, old: Plan, new: Plan) -> list[Transfer]:
    """Every (src, dst, layer) move needed to go from `old` to `new`, in a deterministic order."""
    before, after = layer_owners(graph, old), layer_owners(graph, new)
    moves: list[Transfer] = []
    for layer, new_ranks in after.items():
        old_ranks = before.get(layer, ())
        if not old_ranks:
            continue  # a layer nobody held (no state): nothing to move
        for index, dst in enumerate(new_ranks):
            if dst not in old_ranks:
                moves.append((old_ranks[index % len(old_ranks)], dst, layer))
    return moves


def _layer_keys(engine: MigratingEngine, layer: str) -> list[str]:
    obj = engine.modules[layer]
    if isinstance(obj, torch.Tensor):
        return [layer]
    return [f"{layer}.{key}" for key in obj.state_dict().keys()]


def _get_state(engine: MigratingEngine, key: str) -> torch.Tensor:
    layer, _, rest = key.partition(".")
    obj = engine.modules[layer]
    if isinstance(obj, torch.Tensor):  # a tensor layer's key is its name alone (see the listing above)
        return obj
    return obj.state_dict(keep_vars=True)[rest]


def _cause(error: BaseException) -> str:
    """One line naming what failed on this rank (the first line of the message; tracebacks go to DEBUG)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else 'no message'}"


def _attempt(engine: MigratingEngine, what: str, action: Callable[[], Any]) -> Optional[str]:
    """Run one local part of a switch; its one-line cause if it failed (a dead peer still propagates)."""
    try:
        action()
    except PeerError:
        raise
    except Exception as error:  # anything a layer, allocator or optimizer raises: the switch is undone
        logger.error("rank %d: %s failed: %s", engine.rank, what, _cause(error))
        logger.debug("rank %d: %s failed", engine.rank, what, exc_info=True)
        return _cause(error)
    return None


def _roll_back(engine: MigratingEngine, new_plan: Plan, failures: dict[int, str], start: float) -> SwitchRolledBack:
    """Undo this rank's part of a failed switch: the running stage, its optimizer and the layers it holds were
    never touched; layers that arrived for the new plan go back to meta. Returns the error to raise."""
    before = layer_owners(engine.graph, engine.plan)
    arrived = {layer for layer, ranks in layer_owners(engine.graph, new_plan).items()
               if engine.rank in ranks and engine.rank not in before.get(layer, ())}
    lazy = sorted(arrived & engine.lazy_layers)
    release_layers(engine.modules, lazy)
    if lazy:
        gc.collect()
        return_freed_memory()
    what = "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(failures.items()))
    return SwitchRolledBack(f"the switch to plan v{new_plan.version} failed on {what}; every rank rolled back to "
                            f"plan v{engine.plan.version}", failures, time.perf_counter() - start)


def switch_plan(engine: MigratingEngine, new_plan: Plan) -> float:
    """Move this rank's share of layers to `new_plan` and rebuild its stage; returns the pause in seconds.
    Raises SwitchRolledBack (on every rank alike) when some rank could not take its part: then this rank
    runs the old plan exactly as before (see the module docstring, "Failures")."""
    start = time.perf_counter()
    new_plan = new_plan.with_default_ranks()
    old_plan, rank, timeout = engine.plan, engine.rank, engine.timeout
    engine.check_job(new_plan)
    moves = plan_transfers(engine.graph, old_plan, new_plan)
    # Optimizer state of what this rank holds now, by parameter name (kept layers and outgoing ones).
    opt_state: Mapping[str, Mapping[str, Any]] = {}
    if engine.optimizer is not None and engine.stage is not None:
        # The running optimizer's own tensors, not copies: nothing steps before the switch commits (the new
        # optimizer takes the kept ones over; a rollback keeps the old one), and a copy would be a second
        # optimizer state in memory.
        named = dict(engine.stage.named_parameters())
        # A tied Parameter is named once per stage: under every key of the tie, so it travels (and is
        # found again) under whichever key the sending and receiving stages hold it by.
        if offload_of(engine.optimizer) is not None:
            # Offloaded (runtime/step/offload.py): unread; a kept parameter's state goes from the running
            # optimizer's files into the new one's alone, an outgoing one's is read as its message is built.
            streamed = optimizer_state_by_name(engine.optimizer, named)
            assert isinstance(streamed, StreamedState)
            opt_state = streamed.renamed(expand_state(engine.graph, {name: name for name in streamed}))
        else:
            by_id = {id(p): name for name, p in named.items()}
            opt_state = expand_state(engine.graph, {by_id[id(p)]: dict(state) for p, state in engine.optimizer.state.items()
                                                    if id(p) in by_id})

    outgoing: dict[int, list[str]] = {}
    incoming: dict[int, list[str]] = {}
    for src, dst, layer in moves:
        if src == rank:
            outgoing.setdefault(dst, []).append(layer)
        if dst == rank:
            incoming.setdefault(src, []).append(layer)

    # 1. Room for the arriving layers (a model built on meta), on every rank, before a byte moves: a rank
    #    that cannot hold them could not drain the messages either.
    arriving = [layer for layers in incoming.values() for layer in layers]
    failure = _attempt(engine, f"allocating {len(arriving)} arriving layer(s) for plan v{new_plan.version}",
                       lambda: allocate_layers(engine.modules, arriving, engine.device))
    failures = agree(failure, engine.control_group, timeout, f"the agreement on the switch to plan v{new_plan.version}")
    if failures:
        raise _roll_back(engine, new_plan, failures, start)

    # 2. The move: every rank posts its sends, then receives (a failure to store a value still drains the rest).
    handles = []
    sent_bytes = 0
    for dst in sorted(outgoing):
        manifest: list[list[str]] = []
        values: list[Any] = []
        for layer in outgoing[dst]:
            for key in _layer_keys(engine, layer):
                tensor = _get_state(engine, key).detach()
                manifest.append(["state", key])
                values.append(tensor)
                sent_bytes += tensor.numel() * tensor.element_size()
                for field, value in sorted(opt_state.get(key, {}).items()):
                    manifest.append(["opt", key, field])
                    values.append(value.detach() if isinstance(value, torch.Tensor) else value)
        handles.append(comm.send_values([manifest] + values, dst, comm.TAG_MIGRATION, device=engine.device))

    received_opt: dict[str, dict[str, Any]] = {}
    for src in sorted(incoming):
        message = comm.PendingRecv(src, comm.TAG_MIGRATION, device=engine.device).wait(timeout)
        if failure is None:
            failure = _attempt(engine, f"storing the layers received from rank {src}",
                               lambda: _store(engine, message, received_opt))
        del message
    for handle in handles:
        handle.wait(timeout)

    # 3. The new stage, built beside the running one; live only once every rank built its own.
    # Kept parameters keep their state; arriving ones bring theirs.
    merged = opt_state.with_entries(received_opt) if isinstance(opt_state, StreamedState) else {**opt_state, **received_opt}
    prepared: list[Any] = []
    if failure is None:
        failure = _attempt(engine, f"building the stage of plan v{new_plan.version}",
                           lambda: prepared.append(engine.prepare(new_plan, merged)))
    del merged, opt_state
    failures = agree(failure, engine.control_group, timeout, f"the agreement on the switch to plan v{new_plan.version}")
    if failures:
        prepared.clear()  # the new stage, optimizer and arrived state: dropped before the layers are released
        received_opt.clear()
        raise _roll_back(engine, new_plan, failures, start)
    engine.install(prepared[0])
    pause = time.perf_counter() - start
    logger.info("rank %d: plan v%d -> v%d: sent %d layer(s) (%.1f MB), received %d layer(s), %.1f ms", rank,
                old_plan.version, new_plan.version, sum(len(v) for v in outgoing.values()), sent_bytes / 1e6,
                sum(len(v) for v in incoming.values()), pause * 1e3)
    return pause


def _store(engine: MigratingEngine, message: list[Any], received_opt: dict[str, dict[str, Any]]) -> None:
    """Copy a received migration message into this rank's (arriving) layers; keep its optimizer state."""
    manifest, values = message[0], message[1:]
    with torch.no_grad():
        for entry, value in zip(manifest, values):
            if entry[0] == "state":
                _get_state(engine, entry[1]).copy_(value)
            else:
                received_opt.setdefault(entry[1], {})[entry[2]] = value


def apply_switch(engine: SwitchingEngine, command: Command) -> float:
    """Act on a broadcast `switch` (every rank together): refuse a plan that breaks a rule before anything
    moves, switch, or roll a failed switch back; the coordinator hears of a refusal or a rollback from
    rank 0's channel. Returns the seconds training was paused (0 for a refusal).

    A switch that names a schedule (`--schedule auto` chose it again for the new plan, coordinator/rechoose.py)
    runs the new plan under it: `engine.config` carries it while the new stage is checked and built (`prepare`
    reads it) and keeps it once the switch commits; a refusal or a rollback restores the running one."""
    new_plan = command.plan
    assert new_plan is not None  # Command refuses a switch without a plan
    why = command.reason or "no reason given"
    running = engine.config
    try:  # before anything moves; every rank reaches the same verdict (same graph, plan, world, schedule)
        engine.config = switched_config(running, command.schedule)
        check_switchable(engine.config.schedule)
        check_plan(engine.graph, new_plan, engine.world_size, engine.config.schedule, engine.modules)
    except ModelParallelError as error:
        engine.config = running
        logger.error("%s refusing the switch to plan v%d (%s): %s; training goes on with plan v%d", engine.prefix,
                     new_plan.version, why, error, engine.plan.version)
        refused = getattr(engine.channel, "switch_refused", None)  # tell the coordinator (rank 0's channel)
        if engine.rank == 0 and refused is not None:
            refused(new_plan.version, str(error))
        return 0.0
    try:
        # A span for the pause (the docs' `migration` lane): without it the trace showed only a gap.
        with engine.tracer.span(f"migration to plan v{new_plan.version}", lane="migration", plan_version=new_plan.version):
            pause = switch_plan(engine, new_plan)
    except SwitchRolledBack as failed:  # every rank raised it together: all run the old plan again
        engine.config = running
        logger.error("%s %s (%s) after %.1f ms; training goes on with plan v%d", engine.prefix, failed, why,
                     failed.pause_s * 1e3, engine.plan.version)
        report = getattr(engine.channel, "switch_failed", None)
        if engine.rank == 0 and report is not None:
            report(new_plan.version, failed.failures)
        return failed.pause_s
    except BaseException:  # a dead peer ends the run: the engine still says what it ran
        engine.config = running
        raise
    engine.switch_pauses_ms.append(pause * 1e3)
    engine.tracer.instant(f"switch to plan v{new_plan.version}")
    if isinstance(getattr(engine.channel, "schedule", None), str):  # a coordinator's: re-registering names the running one
        setattr(engine.channel, "schedule", engine.config.schedule)
    if engine.rank == 0:
        changed = f" under schedule {engine.config.schedule} (was {running.schedule})" \
            if engine.config.schedule != running.schedule else ""
        logger.warning("%s switched to plan v%d%s in %.1f ms%s", engine.prefix, new_plan.version, changed, pause * 1e3,
                       f" ({command.reason})" if command.reason else "")
        choice = dict(new_plan.extra).get("schedule")
        if command.schedule is not None and isinstance(choice, dict) and isinstance(choice.get("line"), str):
            logger.info("%s %s", engine.prefix, choice["line"][:2000])  # the coordinator's re-choice, as it logged it
    return pause


def switched_config(config: TrainConfig, schedule: Optional[str]) -> TrainConfig:
    """The config a switch to a plan under `schedule` runs with (None: the running one). Only a schedule
    `--schedule auto` chose may change at a switch: a fixed one is the user's (ConfigError otherwise)."""
    if schedule is None or schedule == config.schedule:
        return config
    if not config.schedule_auto:
        raise ConfigError(f"the switch names schedule {schedule!r}, but this job runs the fixed schedule "
                          f"{config.schedule!r}; only a job started with --schedule auto changes its schedule live")
    return replace(config, schedule=schedule)
