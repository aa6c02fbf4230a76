"""Checks on what a checkpoint reader takes from disk: the manifest's fields, the shard files, their payloads.

A checkpoint directory is data from outside the process (hand-edited, copied, half-restored from a
backup, planted): every field is checked before use, a shard is read only if it is a regular file of
the recorded size (a symlink to /dev/zero or a FIFO is refused without reading), and a payload must
have the structure `save_shard` writes. Every failure is a one-line CheckpointError naming the file.
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import torch

from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint.layout import PICKLED_SUFFIX

# What to do with a damaged step: without it and the pointer, --resume (and export) take the newest step still
# committed (layout.latest_step). No flag picks a step: the directory is the choice.
FIX = "delete this step directory and the 'latest' pointer beside it: --resume then starts from the newest step still committed"
# Far above any real shard, far below what would exhaust memory by accident: a field, not a promise.
MAX_SHARD_BYTES = 1 << 40
MAX_STEP = 1 << 53  # exact in a JSON double; a step past it is a corrupt field, not a long run


def _show(value: Any) -> str:
    return repr(str(value)[:40])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manifest(manifest: dict[str, Any], path: Path, step: int) -> None:
    """Raise CheckpointError unless `manifest` (of directory step_<step>) has every key the reader uses,
    with sane types and values (a hand-edited or foreign manifest must not surface as KeyError/TypeError
    deep in Checkpoint, nor resume at step 10^30)."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: malformed manifest: {what}; {FIX}")

    for key, kind in (("step", int), ("model_fingerprint", str), ("shards", list)):
        value = manifest.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise bad(f"{key!r} must be a {kind.__name__}, found {_show(value)}")
    if not 0 <= step <= MAX_STEP:
        raise bad(f"step {step} is outside 0..{MAX_STEP}")
    if manifest["step"] != step:
        raise bad(f"'step' is {manifest['step']} but the directory is step_{step} (a renamed or copied step directory)")
    for key in ("world", "extra"):
        if not isinstance(manifest.get(key, {}), dict):
            raise bad(f"{key!r} must be an object, found {_show(manifest.get(key))}")
    next_step = manifest.get("extra", {}).get("next_step", step + 1)
    if not _is_int(next_step) or not 0 <= next_step <= step + 1:
        raise bad(f"extra.next_step must be a whole number of steps in 0..{step + 1} (the checkpoint is of step {step}), "
                  f"found {_show(next_step)}")
    if not manifest["shards"]:
        raise bad("'shards' is empty")
    ranks: set[int] = set()
    files: set[str] = set()
    for number, shard in enumerate(manifest["shards"]):
        _check_shard_entry(shard, f"shards[{number}]", bad)
        if shard["rank"] in ranks or shard["file"] in files:
            raise bad(f"shards[{number}] repeats rank {shard['rank']} or file {_show(shard['file'])}")
        ranks.add(shard["rank"])
        files.add(shard["file"])


def _check_shard_entry(shard: Any, where: str, bad: Any) -> None:
    if not isinstance(shard, dict):
        raise bad(f"{where} must be an object, found {_show(shard)}")
    for key, kind in (("rank", int), ("file", str), ("sha256", str), ("params", dict), ("buffers", list)):
        value = shard.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise bad(f"{where}.{key} must be a {kind.__name__}, found {_show(value)}")
    if not 0 <= shard["rank"] < MAX_STEP:
        raise bad(f"{where}.rank must be a rank >= 0, found {shard['rank']}")
    name = shard["file"]
    # The shard file must stay inside the step directory: a manifest is data, not a path to follow.
    if name in ("", ".", "..") or "\x00" in name or "/" in name or "\\" in name or Path(name).name != name:
        raise bad(f"{where}.file must be a file name in the step directory, found {_show(name)}")
    size = shard.get("bytes")
    if size is not None and (not _is_int(size) or not 0 < size <= MAX_SHARD_BYTES):
        raise bad(f"{where}.bytes must be the shard's size in bytes (1..{MAX_SHARD_BYTES}), found {_show(size)}")
    if not all(isinstance(n, str) for n in shard["buffers"]):
        raise bad(f"{where}.buffers must list names (strings)")
    for name, entry in shard["params"].items():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                and all(_is_int(d) and d >= 0 for d in entry[0]) and isinstance(entry[1], str)):
            raise bad(f"{where}.params[{name[:40]!r}] must be [shape, dtype], found {_show(entry)}")


def refuse_pickled(manifest: dict[str, Any], manifest_path: Path, root: Path) -> None:
    """Shards of earlier versions (torch pickles) are never read: nothing read from a file is unpickled."""
    pickled = [s["file"] for s in manifest["shards"] if s["file"].endswith(PICKLED_SUFFIX)]
    if pickled:
        raise CheckpointError(
            f"{manifest_path}: its shards ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}) were written "
            f"by an earlier model_parallel as torch pickles, which this version does not read (a pickle can run code); "
            f"if you trust these files, convert the checkpoint once with: model-parallel checkpoint-upgrade {root}")


def shard_digest(file: Path, expected: int | None, rank: int) -> tuple[int, str]:
    """(size, sha256) of a shard file: a regular file (followed symlinks included) of `expected` bytes, read in
    pieces no further than that; a device, FIFO or directory is refused before reading (it could be endless)."""
    fix = FIX
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the type check below then refuses it.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: shard of rank {rank} is missing; the checkpoint is incomplete, {fix}") from None
    except OSError as error:
        raise CheckpointError(f"{file}: cannot open the shard of rank {rank} ({error.strerror or error}); {fix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file}: the shard of rank {rank} is not a regular file (a device, FIFO or "
                                  f"directory, possibly behind a symlink); it was not read; {fix}")
        limit = expected if expected is not None else info.st_size
        if info.st_size != limit or limit > MAX_SHARD_BYTES:
            raise CheckpointError(f"{file}: the shard of rank {rank} has {info.st_size} bytes, the manifest records "
                                  f"{limit}; it was truncated or replaced, {fix}")
        os.set_blocking(fd, True)
        # In pieces, into one buffer: a shard holds a rank's whole optimizer state.
        digest, left, piece = hashlib.sha256(), limit, bytearray(1 << 24)
        while left > 0:
            got = os.readv(fd, [memoryview(piece)[:min(left, len(piece))]])
            if not got:
                break
            digest.update(memoryview(piece)[:got])
            left -= got
        if left:
            raise CheckpointError(f"{file}: the shard of rank {rank} ended {left} bytes early; {fix}")
        return limit, digest.hexdigest()
    except OSError as error:
        raise CheckpointError(f"{file}: cannot read the shard of rank {rank} ({error.strerror or error}); {fix}") from None
    finally:
        os.close(fd)


def check_payload(payload: Any, meta: dict[str, Any], file: Path) -> dict[str, Any]:
    """`payload` (a shard's skeleton, shardio.ShardReader) has the structure save_shard writes and holds the tensors its
    manifest entry lists, with the recorded shapes; returns it."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: the shard of rank {meta['rank']} is malformed ({what}); {FIX}")

    if not isinstance(payload, dict):
        raise bad(f"a {type(payload).__name__}, not the saved dictionary")
    for key in ("params", "buffers", "optimizer", "extra"):
        if not isinstance(payload.get(key), dict):
            raise bad(f"{key!r} is {type(payload.get(key)).__name__}, expected a dictionary")
    for section, names in (("params", list(meta["params"])), ("buffers", meta["buffers"])):
        for name in names:
            value = payload[section].get(name)
            if not isinstance(value, torch.Tensor):
                raise bad(f"{section} {name[:60]!r} is {type(value).__name__}, expected a tensor")
            if section == "params" and list(value.shape) != list(meta["params"][name][0]):
                raise bad(f"{name[:60]!r} has shape {list(value.shape)}, the manifest records {meta['params'][name][0]}")
    for name, state in payload["optimizer"].items():
        if name not in meta["params"] or not isinstance(state, dict):
            raise bad(f"optimizer state {str(name)[:60]!r} is not a dictionary of one of the shard's parameters")
    return payload
