"""Checkpoints keyed by layer-level parameter names, so a run resumes under any partition or world size.

API (stable; the runtime calls these):

    save_shard(directory, step, rank, params, buffers=None, optimizer_state=None, extra=None) -> Path
        Every rank that owns a stage's state writes one shard (a replicated stage writes it once,
        from its first replica). `params` / `buffers` map stage-module state-dict names
        (`layer1_0_conv1.weight`, see docs/ARCHITECTURE.md "Parameter names") to tensors;
        `optimizer_state` maps the same parameter names to `{"momentum_buffer": Tensor, "step": 3}`;
        `extra` holds tensors, None, bools, numbers (inf and nan too), strings, and lists, tuples and
        dicts of them (any of these as keys) - e.g. this rank's RNG state; anything else is refused.
    finalize(directory, step, world_info, model_fingerprint, expected_ranks=None, extra=None) -> Path
        Called by one rank after every shard is written (the runtime agrees on that first).
        Checks the shards of `expected_ranks` (present, keys disjoint, parameters matching the
        fingerprint), writes `step_<N>/manifest.json`, then atomically moves the `latest` pointer.
    load_checkpoint(directory, step=None, expected_fingerprint=None) -> Checkpoint
        `step=None` follows `latest`. `Checkpoint.params(keys)`, `.buffers(keys)`,
        `.optimizer_state(keys)`, `.load_into(module, stored=None)`, `.extra` (finalize's), `.shard_extra(rank)`.
    list_checkpoints(directory) -> [N, ...] / latest_step(directory) -> N    the committed steps
    model_fingerprint(named) -> str
        Hash of sorted parameter names + shapes + dtypes. Accepts a module, or a mapping of names to
        tensors or to `(shape, dtype)`; original names (`layer1.0.conv1.weight`) and stage-module
        names (`layer1_0_conv1.weight`) give the same fingerprint.
    optimizer_state_by_name(optimizer, named_params) / load_optimizer_state_by_name(optimizer, named_params, state)
        Convert a torch.optim optimizer's per-parameter state to/from the name-keyed form.

Layout of a checkpoint directory:

    <directory>/latest                   text "step_<N>", replaced atomically (the commit point)
    <directory>/step_<N>/shard_<rank>.safetensors  {"params", "buffers", "optimizer", "extra"} as safetensors,
                                          written and read a tensor at a time, never unpickled (shardio.py)
    <directory>/step_<N>/shard_<rank>.json  index of the shard: keys, shapes, sha256 (written after it)
    <directory>/step_<N>/manifest.json    written by finalize after all shards: shards, world, fingerprint
    <directory>/step_<N>/graph.json       the graph the run trained, and config.json for a Hugging Face
                                          model (written before the manifest by commit.py: model_files.py)

Crash safety: every file is written atomically (temporary file + rename, fsync of the file and of
its directory). A checkpoint counts once `latest` names it: until then a reader sees the previous
one, whole, and reads only the shard files its manifest lists (checked by sha256), so whatever an
interrupted write left (a step directory without a manifest or past `latest`, shards of ranks the
manifest does not list, `.tmp` files) is ignored; `commit.prune` removes it. If the
pointer itself is lost, the newest step directory with a manifest is used.

Independent of torch.distributed: `commit.py` is the runtime's protocol around these
(who writes, agreeing on the outcome across ranks, cleaning up, keeping the last K);
`state.py` holds the fingerprint and optimizer-state helpers re-exported here.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from model_parallel import jsonbound
from model_parallel.errors import CheckpointError
from model_parallel.fileio import atomic_write, atomic_write_json, atomic_write_text
from model_parallel.runtime.checkpoint.check import FIX, check_manifest, check_payload, refuse_pickled, shard_digest
from model_parallel.runtime.checkpoint.layout import (  # noqa: F401 - part of this module's API
    LATEST,
    MANIFEST,
    PathLike,
    fsync_dir,
    latest_step,
    list_checkpoints,
    shard_path,
    step_dir,
    step_dirs,
)
from model_parallel.runtime.checkpoint.shardio import ShardReader, write_shard_file
from model_parallel.userfile import read_bytes
from model_parallel.runtime.checkpoint.state import (  # noqa: F401 - part of this module's API
    OptimizerState,
    StreamedState,
    _dtype_name,
    _fingerprint,
    load_optimizer_state_by_name,
    model_fingerprint,
    optimizer_state_by_name,
    split_state,
)

logger = logging.getLogger(__name__)

FORMAT = "model_parallel.checkpoint"
VERSION = 1


# ----------------------------------------------------------------------------- writing


def _tensor_dict(values: Optional[Mapping[str, torch.Tensor]], what: str, rank: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, value in (values or {}).items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"save_shard(rank {rank}): {what} {name!r} must be a tensor, got {type(value).__name__}")
        out[name] = value.detach().cpu().contiguous()
    return out


def save_shard(
    directory: PathLike,
    step: int,
    rank: int,
    params: Mapping[str, torch.Tensor],
    buffers: Optional[Mapping[str, torch.Tensor]] = None,
    optimizer_state: Optional[OptimizerState] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Write this rank's shard of checkpoint `step` (atomically), then its small JSON index."""
    if step < 0:
        raise CheckpointError(f"save_shard(rank {rank}): step must be >= 0, got {step}")
    params_t = _tensor_dict(params, "parameter", rank)
    buffers_t = _tensor_dict(buffers, "buffer", rank)
    overlap = sorted(set(params_t) & set(buffers_t))
    if overlap:
        raise CheckpointError(f"save_shard(rank {rank}): names are both parameter and buffer: {overlap[:5]}")
    optimizer = optimizer_state if optimizer_state is not None else {}
    for name in optimizer:  # a StreamedState (an offloaded optimizer's) is not read here: names only
        if name not in params_t:
            raise CheckpointError(
                f"save_shard(rank {rank}): optimizer state for {name!r}, which is not among this shard's "
                f"parameters; key optimizer state by the same stage-module parameter names"
            )
    path, written = shard_path(directory, step, rank), list[tuple[int, str]]()
    with _naming(path):  # straight into the temporary file renamed into place, a tensor (a parameter's state) at a time
        atomic_write(path, lambda f: written.append(
            write_shard_file(f, params_t, buffers_t, optimizer, dict(extra or {}), path)), binary=True, readable=True)
    size, sha256 = written[0]
    index = {
        "rank": rank,
        "step": step,
        "file": path.name,
        "bytes": size,
        "sha256": sha256,
        "params": {k: [list(v.shape), _dtype_name(v.dtype)] for k, v in params_t.items()},
        "buffers": sorted(buffers_t),
    }
    # The index is written after the shard: an index on disk means its shard is complete.
    with _naming(path.with_suffix(".json")):
        atomic_write_json(path.with_suffix(".json"), index)
        fsync_dir(path.parent)
    logger.debug("rank %d wrote checkpoint shard %s (%d bytes)", rank, path, size)
    return path


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError from a write names the file it was for: a full disk's `write()`/`fsync()` error does not
    (`[Errno 28] No space left on device`, no file), and the message must say where to free space."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            raise OSError(error.errno, error.strerror or str(error), str(path)) from None
        raise


def _read_json(path: Path, what: str) -> Any:
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: {what} is missing")
    text = read_bytes(path, error=CheckpointError, what=what, max_bytes=jsonbound.MAX_FILE_BYTES,
                      fix="delete this step directory and resume from an earlier one")
    # Bounded: a hostile manifest (deep nesting, a 5000-digit step) is a CheckpointError, not a traceback.
    try:
        return jsonbound.loads(text, where=path.name, error=CheckpointError)
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {what} is corrupt ({error}); delete this step directory and resume from an earlier one") from None


def finalize(
    directory: PathLike,
    step: int,
    world_info: Mapping[str, Any],
    model_fingerprint: Optional[str],
    expected_ranks: Optional[Iterable[int]] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Commit checkpoint `step`: verify its shards, write the manifest, then move `latest` to it.

    `world_info` (JSON) records how the run was laid out (world size, plan version, stage -> ranks);
    `extra` (JSON) holds run-level state (data position, LR-scheduler state). `expected_ranks`, when
    given, are the ranks whose shards make the checkpoint: only theirs are read, so shards left in the
    directory by an earlier, uncommitted attempt at this step (say with more ranks) are not part of it.
    Raises CheckpointError (and leaves `latest` where it was) if a shard is missing, two shards hold
    the same name, or the parameters do not match `model_fingerprint` (None: record the shards' own
    fingerprint, without that check).
    """
    folder = step_dir(directory, step)
    if expected_ranks is None:
        indexes = sorted(folder.glob("shard_*.json"))
    else:
        indexes = [shard_path(directory, step, rank).with_suffix(".json") for rank in sorted(set(expected_ranks))]
        missing = [rank for rank, p in zip(sorted(set(expected_ranks)), indexes) if not p.is_file()]
        if missing:
            found = sorted(int(m.group(1)) for p in folder.glob("shard_*.json") if (m := re.match(r"shard_(\d+)\.json$", p.name)))
            raise CheckpointError(f"{folder}: shards of ranks {missing} are missing (found ranks {found}); did those ranks fail in save_shard?")
    if not indexes:
        raise CheckpointError(f"{folder}: no shard was written for step {step}; call save_shard on the owning ranks before finalize")
    shards = sorted((_read_json(p, "shard index") for p in indexes), key=lambda s: s["rank"])
    owner: dict[str, int] = {}
    shapes: dict[str, tuple[list[int], str]] = {}
    for shard in shards:
        for name in list(shard["params"]) + list(shard["buffers"]):
            if name in owner:
                raise CheckpointError(
                    f"{folder}: {name!r} is in the shards of rank {owner[name]} and rank {shard['rank']}; "
                    f"a replicated stage must write its shard from one replica only"
                )
            owner[name] = shard["rank"]
        shapes.update({k: (v[0], v[1]) for k, v in shard["params"].items()})
    actual = _fingerprint(shapes)
    if model_fingerprint is None:
        model_fingerprint = actual
    elif actual != model_fingerprint:
        raise CheckpointError(
            f"{folder}: the shards' parameters have fingerprint {actual}, expected {model_fingerprint} "
            f"({len(shapes)} parameters found); a shard is missing or a rank saved the wrong names"
        )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model_fingerprint": model_fingerprint,
        "world": dict(world_info),
        "extra": dict(extra or {}),
        "shards": shards,
    }
    with _naming(folder / MANIFEST):
        manifest_path = atomic_write_json(folder / MANIFEST, manifest)
        fsync_dir(folder)
    # The commit point: until this rename a reader still sees the previous checkpoint. The directory's
    # fsync makes it durable: a power loss must not bring back a pointer older than what was reported.
    with _naming(Path(directory) / LATEST):
        atomic_write_text(Path(directory) / LATEST, f"step_{step}\n")
        fsync_dir(directory)
    logger.info("checkpoint step %d committed in %s (%d shards)", step, folder, len(shards))
    return manifest_path



# ----------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """A committed checkpoint; shards are read lazily (only those holding the keys asked for)."""

    path: Path
    step: int
    fingerprint: str
    world: dict[str, Any]
    extra: dict[str, Any]
    _shards: list[dict[str, Any]]
    _owner: dict[str, int] = field(default_factory=dict)
    _loaded: dict[int, dict[str, Any]] = field(default_factory=dict)
    _readers: dict[int, ShardReader] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for index, shard in enumerate(self._shards):
            for name in list(shard["params"]) + list(shard["buffers"]):
                self._owner[name] = index

    @property
    def param_names(self) -> list[str]:
        return sorted(n for s in self._shards for n in s["params"])

    @property
    def buffer_names(self) -> list[str]:
        return sorted(n for s in self._shards for n in s["buffers"])

    @property
    def ranks(self) -> list[int]:
        return sorted(s["rank"] for s in self._shards)

    def _shard(self, index: int) -> dict[str, Any]:
        if index not in self._loaded:
            meta = self._shards[index]
            file = self.path / meta["file"]
            size, digest = shard_digest(file, meta.get("bytes"), meta["rank"])
            if digest != meta["sha256"]:
                raise CheckpointError(
                    f"{file}: shard of rank {meta['rank']} is corrupt (checksum differs from {MANIFEST}); {FIX} "
                    "(in Python: load_checkpoint(directory, step=...))"
                )
            try:
                reader = ShardReader(file, size)
            except Exception as error:  # torch raises several types for unreadable data
                if isinstance(error, CheckpointError):
                    raise
                reason = str(error).splitlines()[0][:200] if str(error) else ""
                raise CheckpointError(f"{file}: cannot be read ({type(error).__name__}: {reason}); {FIX}") from None
            skeleton = check_payload(reader.skeleton, meta, file)
            # Meta tensors: a tensor (a parameter's optimizer state) is read from the file when it is asked for.
            self._readers[index] = reader
            self._loaded[index] = {**skeleton, "extra": reader.materialize(skeleton["extra"])}
        return self._loaded[index]

    def _lookup(self, keys: Optional[Iterable[str]], section: str) -> dict[str, Any]:
        return {name: self._read(self._owner[name], self._shard(self._owner[name])[section][name])
                for name in self._known(keys, section)}

    def _read(self, index: int, skeleton: Any) -> Any:
        """A part of shard `index`'s skeleton with its tensors read from the file."""
        return self._readers[index].materialize(skeleton)

    def _known(self, keys: Optional[Iterable[str]], section: str) -> list[str]:
        """`keys` (None: all of `section`), each checked to be in this checkpoint's `section`."""
        names = (self.param_names if section == "params" else self.buffer_names) if keys is None else list(keys)
        for name in names:
            index = self._owner.get(name)
            if index is None or name not in self._shards[index][section]:
                kind = "parameter" if section == "params" else "buffer"
                raise CheckpointError(
                    f"{self.path}: no {kind} {name!r} in checkpoint step {self.step} "
                    f"(it has {len(self._owner)} names, e.g. {sorted(self._owner)[:3]}); "
                    f"is this checkpoint from another model version?"
                )
        return names

    def params(self, keys: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
        """Parameter tensors by stage-module name (all of them when `keys` is None)."""
        return self._lookup(keys, "params")

    def buffers(self, keys: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
        return self._lookup(keys, "buffers")

    def optimizer_state(self, keys: Optional[Iterable[str]] = None) -> StreamedState:
        """Optimizer state of the named parameters (a parameter without state is left out), read from the shard
        one parameter at a time as each entry is asked for."""
        names = self._known(keys, "params")
        layout = {name: state for name in names
                  if (state := self._shard(self._owner[name])["optimizer"].get(name)) is not None}
        return StreamedState(layout, lambda name: self._read(self._owner[name], layout[name]),
                             lambda name: self._readers[self._owner[name]].ranges(layout[name]))

    def shard_extra(self, rank: int) -> dict[str, Any]:
        """The `extra` a rank passed to save_shard (CheckpointError if that rank wrote no shard)."""
        for index, shard in enumerate(self._shards):
            if shard["rank"] == rank:
                return self._shard(index)["extra"]
        raise CheckpointError(f"{self.path}: rank {rank} wrote no shard (shards from ranks {self.ranks})")

    def load_into(self, module: nn.Module, stored: Optional[Mapping[str, str]] = None) -> None:
        """Copy this checkpoint's values into every parameter and persistent buffer of a stage module.
        `stored` maps a module key to the parameter it is stored as (a tied copy: runtime/build/tied.py)."""
        stored = stored or {}
        param_part, buffer_part = split_state(module)
        tied = [k for k in list(param_part) + list(buffer_part) if k in stored]
        sources = {**{k: ("params", stored.get(k, k)) for k in list(param_part) + tied},
                   **{k: ("buffers", k) for k in buffer_part if k not in stored}}
        for section in ("params", "buffers"):
            self._known(sorted({key for kind, key in sources.values() if kind == section}), section)
        state = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, (section, key) in sources.items():  # one tensor read at a time
                value, tensor = self._lookup([key], section)[key], state[name]
                if value.shape != tensor.shape:
                    raise CheckpointError(f"{self.path}: {name!r} has shape {tuple(value.shape)} in the checkpoint, {tuple(tensor.shape)} in the module")
                tensor.copy_(value)


def load_checkpoint(directory: PathLike, step: Optional[int] = None, expected_fingerprint: Optional[str] = None,
                    fix: str = "give the --checkpoint_dir of a training run that committed one") -> Checkpoint:
    """Open checkpoint `step` (default: the one `latest` points at) of `directory`; `fix` ends the error of a
    folder without one (each caller's: resume, export and --weights are fixed differently)."""
    root = Path(directory)
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"{root}: no committed checkpoint (no '{LATEST}' pointer, no step_<N>/{MANIFEST}); {fix}")
    folder = step_dir(root, step)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path}: missing, so step {step} was never committed (committed steps: {list_checkpoints(root)}); "
            f"delete {folder} and the '{LATEST}' pointer naming it: --resume then starts from the newest committed step"
        )
    manifest = _read_json(manifest_path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{manifest_path}: format version {manifest.get('version')}, this code reads version {VERSION}")
    check_manifest(manifest, manifest_path, step)
    refuse_pickled(manifest, manifest_path, root)
    fingerprint = manifest["model_fingerprint"]
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise CheckpointError(
            f"{manifest_path}: checkpoint belongs to another model (fingerprint {fingerprint}, this model "
            f"{expected_fingerprint}: parameter names, shapes or dtypes differ); use a fresh checkpoint directory"
        )
    return Checkpoint(
        path=folder,
        step=int(manifest["step"]),
        fingerprint=fingerprint,
        world=manifest.get("world", {}),
        extra=manifest.get("extra", {}),
        _shards=manifest["shards"],
    )
