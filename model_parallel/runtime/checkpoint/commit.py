"""The runtime's checkpoint protocol across ranks: write, agree, commit, clean up, keep the last K.

At a checkpoint of step N, on every rank together:

    first replica of each stage   save_shard(step_N/shard_<rank>.safetensors + .json)   (errors caught)
    every rank                    share_failure: one all-reduce of "who failed", then the first
                                  failed rank broadcasts its message
                                  -> any failure: every rank raises "checkpoint write failed on rank R: ..."
    rank 0                        step_N/graph.json (+ config.json of an HF model: model_files.py),
                                  finalize (manifest of the writers' shards, fsync, move `latest`,
                                  fsync), then prune (older than the last K, leftovers)
    every rank                    share_failure again -> "checkpoint commit failed on rank 0: ..."

So a disk that fills up on one rank ends the job with that cause on every rank, instead of the
others timing out in a barrier and blaming the rank that left. A process killed anywhere in this
leaves `latest` on the previous checkpoint; `prune` (rank 0, at start and after each commit)
removes what the interrupted write left behind.

Test hooks (environment, read at each checkpoint): `MP_TEST_CHECKPOINT_STALL=<step>` makes every rank
block after writing its shard of checkpoint <step>, before the commit, until it is killed (so a
test can kill -9 a run mid-checkpoint at a known point); `MP_TEST_CHECKPOINT_ENOSPC=<rank>` makes that
rank's shard writes fail as a full disk would; `MP_TEST_CRASH_AT_CHECKPOINT=<rank>:<step>` makes that rank
exit (code 1, as a crash) when checkpoint <step> begins, on torchrun's first attempt only (so a test sees a
restart lose the steps since the last commit and resume).
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.errors import CheckpointError, PeerError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.checkpoint.check import check_manifest
from model_parallel.runtime.checkpoint.model_files import write_model_files
from model_parallel.runtime.checkpoint.state import StreamedState
from model_parallel.runtime.checkpoint.store import (
    MANIFEST,
    _read_json,
    finalize,
    latest_step,
    list_checkpoints,
    optimizer_state_by_name,
    save_shard,
    shard_path,
    split_state,
    step_dir,
    step_dirs,
)
from model_parallel.runtime.config import RunOptions
from model_parallel.runtime.wire import comm
from model_parallel.runtime.wire.agreement import broadcast_json

logger = logging.getLogger(__name__)

STALL_ENV = "MP_TEST_CHECKPOINT_STALL"
ENOSPC_ENV = "MP_TEST_CHECKPOINT_ENOSPC"
CRASH_ENV = "MP_TEST_CRASH_AT_CHECKPOINT"
_STALL_LIMIT_S = 600.0  # a stalled test worker gives up on its own if nobody kills it
_SHARD_FILE = re.compile(r"^shard_\d+\.(safetensors|pt|json)$")  # .pt: an earlier version's


class AgreeingEngine(Protocol):
    """What `agree` needs of a rank's engine: who it is, the group of every rank, how to name a dead peer."""

    rank: int
    world_size: int
    control_group: Any  # a torch.distributed process group of every rank

    @property
    def timeout(self) -> float: ...

    def diagnose(self, error: PeerError) -> PeerError: ...


class CheckpointingEngine(AgreeingEngine, Protocol):
    """What writing and committing a checkpoint needs of a rank's engine (`PipelineEngine` is one)."""

    graph: Graph
    plan: Plan
    model: nn.Module  # the whole model (on meta where stages were built from it): its Hugging Face config
    options: RunOptions
    stage: Optional[nn.Module]  # None on a spare
    optimizer: Optional[torch.optim.Optimizer]
    replica: int  # this rank's index among its stage's replicas: replica 0 writes the stage's shard

    @property
    def prefix(self) -> str: ...

    def fingerprint(self) -> str: ...

    def training_record(self, next_step: int) -> dict[str, Any]: ...


def save_and_commit(engine: CheckpointingEngine, step: int) -> None:
    """Checkpoint `step` of a running PipelineEngine; every rank calls it at the same step."""
    directory = engine.options.checkpoint_dir
    assert directory is not None
    _crash_if_asked(engine, step)
    error = None
    if engine.stage is not None and engine.replica == 0:
        try:
            _write_shard(engine, engine.stage, directory, step)
        except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it (not time out)
            error = _describe(exc)
            logger.error("%s checkpoint step %d: writing the shard failed: %s", engine.prefix, step, error)
    _stall_if_asked(engine, step)
    failure = agree(engine, error)
    if failure is not None:
        raise CheckpointError(f"checkpoint write failed on {failure}; no checkpoint of step {step} was committed, "
                              f"'latest' still names the previous one")
    error = None
    if engine.rank == 0:
        writers = [s.ranks[0] for s in engine.plan.stages]
        try:
            commit_step(directory, step, engine.graph, engine.model, manifest_fields(engine, step), writers)
        except Exception as exc:  # noqa: BLE001 - as above
            error = _describe(exc)
        else:
            prune(directory, engine.options.keep_checkpoints)
    failure = agree(engine, error)
    if failure is not None:
        raise CheckpointError(f"checkpoint commit failed on {failure}; --resume continues from the checkpoint "
                              f"'latest' names")


def shard_state(engine: CheckpointingEngine, stage: nn.Module) -> tuple[dict[str, Any], dict[str, Any], Mapping[str, Any]]:
    """(parameters, buffers, optimizer state) of a rank's shard, keyed as a checkpoint stores them (also what
    --recover takes from a live replica: runtime/checkpoint/live.py)."""
    from model_parallel.runtime.build.tied import stored_keys, without_aliases

    # A tied tensor is stored once, under its first user's key, by the stage holding that user (its
    # optimizer state too, whichever name the stage gave the Parameter).
    params, buffers = (without_aliases(part, engine.graph) for part in split_state(stage))
    opt = optimizer_state_by_name(engine.optimizer, dict(stage.named_parameters())) if engine.optimizer else {}
    stored = stored_keys(engine.graph)
    names = {stored.get(name, name): name for name in opt if stored.get(name, name) in params}
    # An offloaded optimizer's state stays unread (StreamedState): the shard writer reads it a parameter at a time.
    opt = opt.renamed(names) if isinstance(opt, StreamedState) else {new: opt[old] for new, old in names.items()}
    return params, buffers, opt


def _write_shard(engine: CheckpointingEngine, stage: nn.Module, directory: str, step: int) -> None:
    params, buffers, opt = shard_state(engine, stage)
    if os.environ.get(ENOSPC_ENV, "") == str(engine.rank):
        # As the write of a full disk fails: an OSError carrying errno ENOSPC and the file name.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard_path(directory, step, engine.rank)))
    save_shard(directory, step, engine.rank, params, buffers, opt)


def manifest_fields(engine: CheckpointingEngine, step: int) -> dict[str, Any]:
    """What the manifest of checkpoint `step` records besides its shards (the world, fingerprint, training)."""
    return {"world": {"world_size": engine.world_size, "plan": engine.plan.to_dict()}, "fingerprint": engine.fingerprint(),
            "extra": {"next_step": step + 1, "training": engine.training_record(step + 1)}}


def commit_step(directory: str, step: int, graph: Graph, model: Any, fields: dict[str, Any], writers: list[int]) -> None:
    """Rank 0, once every writer's shard is on disk: the model files, the manifest, then `latest` (the commit)."""
    # Before the manifest: a committed checkpoint holds what `model-parallel export` needs (model_files.py).
    write_model_files(step_dir(directory, step), graph, model)
    finalize(directory, step, fields["world"], fields["fingerprint"], expected_ranks=writers, extra=fields["extra"])


def _describe(exc: Exception) -> str:
    # An OSError's text already says what (errno, reason, file); anything else is named by its type.
    return str(exc) if isinstance(exc, (OSError, CheckpointError)) else f"{type(exc).__name__}: {exc}"


def _stall_if_asked(engine: CheckpointingEngine, step: int) -> None:
    if os.environ.get(STALL_ENV, "") != str(step):
        return
    logger.warning("%s test hook %s: stalled in checkpoint step %d after the shard write, before the commit",
                   engine.prefix, STALL_ENV, step)
    deadline = time.monotonic() + _STALL_LIMIT_S
    while time.monotonic() < deadline:
        time.sleep(0.2)  # waiting to be killed; nothing is timed against this
    raise CheckpointError(f"test hook {STALL_ENV}: the stalled worker was not killed within {_STALL_LIMIT_S:.0f} s")


def _crash_if_asked(engine: CheckpointingEngine, step: int) -> None:
    if os.environ.get(CRASH_ENV, "") != f"{engine.rank}:{step}" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    logger.error("%s test hook %s: exiting at checkpoint step %d", engine.prefix, CRASH_ENV, step)
    logging.shutdown()
    os._exit(1)


def agree(engine: AgreeingEngine, error: Optional[str]) -> Optional[str]:
    """Every rank learns whether some rank failed: None, or "rank R: <its message>" (the lowest failed rank)."""
    try:
        return share_failure(error, engine.rank, engine.world_size, engine.control_group, engine.timeout)
    except PeerError as exc:
        raise engine.diagnose(exc) from None


def share_failure(error: Optional[str], rank: int, world_size: int, group: Any, timeout: float) -> Optional[str]:
    """Collective over `group` (all ranks): None when no rank passed an error, else "rank R: <error of R>".

    One all-reduce of a flag per rank (the cost of the barrier it replaces); only after a failure
    does the lowest failed rank broadcast its message (as JSON text, never pickled).
    """
    flags = torch.zeros(world_size, dtype=torch.int32)
    if error is not None:
        flags[rank] = 1
    comm.wait_work(dist.all_reduce(flags, group=group, async_op=True), timeout, -1, "checkpoint status all-reduce")
    failed = flags.nonzero().flatten().tolist()
    if not failed:
        return None
    message = broadcast_json(error if rank == failed[0] else None, failed[0], group, timeout)
    others = f" (and on rank(s) {failed[1:]})" if len(failed) > 1 else ""
    return f"rank {failed[0]}: {message}{others}"


def prune(directory: str, keep: Optional[int] = None) -> list[Path]:
    """Remove what no committed checkpoint needs (rank 0 only); returns what was removed.

    Always: step directories that were never committed (no manifest, or past `latest`), shard files
    a committed manifest does not list (an earlier attempt at the step, with more ranks), and `.tmp`
    files of interrupted writes. With `keep`: committed checkpoints older than the newest `keep`.
    Nothing the `latest` checkpoint reads is touched, so ranks may load it meanwhile. A file that cannot
    be removed is logged and left: cleaning is not worth failing a run for.
    """
    root = Path(directory)
    try:
        latest = latest_step(root)
        committed = list_checkpoints(root)
    except CheckpointError as error:
        logger.warning("not cleaning %s: %s", root, error)  # a broken pointer: leave everything for a human
        return []
    kept = set(committed[-keep:] if keep else committed)
    removed: list[Path] = []
    for step, path in step_dirs(root).items():
        if step not in kept:
            why = f"older than the last {keep}" if step in committed else "never committed"
            logger.info("removing checkpoint %s (%s; latest is step %s)", path, why, latest)
            _remove(path, removed)
            continue
        try:
            manifest = _read_json(path / MANIFEST, "manifest")
            check_manifest(manifest, path / MANIFEST, step)
            listed = {s["file"] for s in manifest["shards"]}
        except (CheckpointError, KeyError, TypeError, AttributeError):
            continue  # a malformed manifest: loading it says what is wrong; delete nothing it may have meant
        listed |= {Path(name).with_suffix(".json").name for name in listed}
        for child in path.iterdir():
            if child.name.endswith(".tmp") or (_SHARD_FILE.match(child.name) and child.name not in listed):
                _remove(child, removed)
    for child in root.glob(".*.tmp") if root.is_dir() else ():
        _remove(child, removed)
    if removed:
        logger.debug("pruned %s: %s", root, [str(p) for p in removed])
    return removed


def _remove(path: Path, removed: list[Path]) -> None:
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as error:
        logger.warning("could not remove %s (%s); it is ignored, remove it by hand", path, error)
    else:
        removed.append(path)
