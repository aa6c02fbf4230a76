"""A Hugging Face model directory written whole or not at all: files go to a staging directory beside the target,
then into place (one rename for a new directory). Both exports use it: one process's (`export.write_hf_directory`,
transformers' own `save_pretrained`) and the ranks' (`shard_export`)."""
from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from model_parallel.errors import CheckpointError

__all__ = ["INDEX_NAME", "WEIGHTS_FILE", "make_staging", "weight_files", "move_into_place"]

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")  # what a save writes (and may leave stale)


def make_staging(out: Path) -> Path:
    """An empty directory beside `out`, on its file system (so the final move is a rename). mkdir, not mkdtemp:
    the directory becomes the user's, with the umask's mode, as transformers' own would."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{secrets.token_hex(6)}.partial"
    os.mkdir(staging)
    return staging


def weight_files(directory: Path) -> set[str]:
    """The weight files a save wrote into `directory`."""
    return {path.name for path in directory.iterdir() if WEIGHTS_FILE.fullmatch(path.name)}


def move_into_place(tmp: Path, out: Path, weights: set[str]) -> None:
    """A new directory: one rename. An existing one (a tokenizer may live there): file by file, the index last,
    then the weight files of an earlier save that the new index does not name (as transformers cleans up)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory; pass a directory path")
    names = sorted(p.name for p in tmp.iterdir())
    for name in sorted(names, key=lambda n: n == INDEX_NAME):
        os.replace(tmp / name, out / name)
    for stale in out.iterdir():
        if WEIGHTS_FILE.fullmatch(stale.name) and stale.name not in weights:
            stale.unlink()
    if len(weights) == 1:
        (out / INDEX_NAME).unlink(missing_ok=True)
