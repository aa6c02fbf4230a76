"""Where a checkpoint directory keeps things, and which of its steps count (are committed).

    <directory>/latest                     text "step_<N>": the commit point
    <directory>/step_<N>/shard_<rank>.safetensors   one rank's tensors (shardio.py); shard_<rank>.json its index
    <directory>/step_<N>/manifest.json     the shards that make the checkpoint
    <directory>/step_<N>/graph.json        the graph trained (+ config.json of an HF model: model_files.py)

A step counts once it has a manifest and `latest` names it or a later step; see runtime/checkpoint/store.py.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union

from model_parallel.errors import CheckpointError
from model_parallel.userfile import read_text

LATEST = "latest"
MANIFEST = "manifest.json"
SHARD_SUFFIX = ".safetensors"
PICKLED_SUFFIX = ".pt"  # shards of earlier versions (torch pickles): never read, only converted (cli/checkpoint_upgrade.py)
MAX_POINTER_BYTES = 4096  # "step_<N>\n" is a few bytes; more is not a pointer
_STEP_DIR = re.compile(r"^step_(\d{1,16})$")  # 16 digits hold any step (check.MAX_STEP = 2**53); no 5000-digit int()

PathLike = Union[str, "os.PathLike[str]"]


def step_dir(directory: PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step}"


def shard_path(directory: PathLike, step: int, rank: int) -> Path:
    return step_dir(directory, step) / f"shard_{rank}{SHARD_SUFFIX}"


def fsync_dir(directory: PathLike) -> None:
    """Make the renames inside `directory` durable: a file's fsync does not cover its directory entry."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dirs(directory: PathLike) -> dict[int, Path]:
    """Every `step_<N>` directory, committed or not, by step."""
    root = Path(directory)
    if not root.is_dir():
        return {}
    return {int(m.group(1)): child for child in root.iterdir() if (m := _STEP_DIR.match(child.name)) and child.is_dir()}


def list_checkpoints(directory: PathLike) -> list[int]:
    """Committed steps, ascending: those with a manifest, up to the one `latest` points at.

    A step directory without a manifest is a write that never finished; one with a manifest but past
    `latest` was killed between the manifest and the pointer's move, so it was never committed either.
    """
    steps = sorted(step for step, path in step_dirs(directory).items() if (path / MANIFEST).is_file())
    pointer = _pointer_step(Path(directory))
    return [step for step in steps if pointer is None or step <= pointer]


def latest_step(directory: PathLike) -> Optional[int]:
    """The step `latest` points at; without a pointer, the newest committed step; None if none."""
    step = _pointer_step(Path(directory))
    if step is not None:
        return step
    steps = list_checkpoints(directory)
    return steps[-1] if steps else None


def _pointer_step(directory: Path) -> Optional[int]:
    """The step the `latest` pointer names (None without a pointer)."""
    pointer = directory / LATEST
    if pointer.is_file():
        # `is_file` follows symlinks; read_text still refuses what changed since, and caps the size.
        text = read_text(pointer, error=CheckpointError, what=f"'{LATEST}' pointer", max_bytes=MAX_POINTER_BYTES,
                         fix="expected 'step_<N>'; delete it to fall back to the newest complete step").strip()
        match = _STEP_DIR.match(text)
        if not match:
            raise CheckpointError(f"{pointer}: expected 'step_<N>', found {text[:40]!r}; delete it to fall back to the newest complete step")
        return int(match.group(1))
    return None
