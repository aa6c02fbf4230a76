"""Atomic file writes: a reader sees the old file or the new one, never half of either."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Union

from model_parallel.jsonbound import load_file

PathLike = Union[str, "os.PathLike[str]"]


def atomic_write(path: PathLike, write: Callable[[Any], None], binary: bool = False, readable: bool = False) -> Path:
    """Call `write(file)` on a temporary file beside `path`, fsync it, then rename it into place (`readable`: a
    binary file `write` may also seek in and read back)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, ("w+b" if readable else "wb") if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text))


def atomic_write_json(path: PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json_file(path: PathLike, error: type[Exception], what: str = "file") -> Any:
    """Parse a JSON file; any failure becomes `error` naming the file (and line), never a raw exception.

    Size, nesting depth and numbers are bounded (see `model_parallel.jsonbound`)."""
    return load_file(path, error=error, what=what)


def check_output_path(path: PathLike, error: type[Exception], flag: str, directory: bool = False) -> Path:
    """Refuse, as `error` naming `flag`, an output path a write would fail on after the work is done (a traceback
    once the solve or the grid was finished): a file where a directory is wanted or the reverse, or a parent
    that is a file. Nothing is created here."""
    target = Path(path)
    existing = next(p for p in (target, *target.parents) if p.exists() or p.is_symlink())
    if existing != target and not existing.is_dir():
        raise error(f"{flag} {target}: {existing} is a file, not a directory; give a path under a directory")
    if existing == target and directory and not target.is_dir():
        raise error(f"{flag} {target}: exists and is not a directory; give a new or existing directory")
    if existing == target and not directory and target.is_dir():
        raise error(f"{flag} {target}: is a directory; give a file name (a path inside it, say)")
    return target
