"""Bounded output files: `rank0.json` is the current file, `rank0.1.json` ... `rank0.<keep>.json` older ones."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)


def chunk_path(path: Path, number: int) -> Path:
    """`rank0.json` (number 0, the current file) or `rank0.<number>.json` (closed, older with each number)."""
    return path if number == 0 else path.with_name(f"{path.stem}.{number}{path.suffix}")


def rotate(path: Path, keep: int) -> None:
    """Shift the closed files one number up, deleting the one past `keep`, and the current file to `.1`
    (with `keep` 0 the current file is deleted): the files take at most `keep + 1` times the size limit."""
    chunk_path(path, keep).unlink(missing_ok=True)
    for number in range(keep - 1, -1, -1):
        source = chunk_path(path, number)
        if source.exists():
            os.replace(source, chunk_path(path, number + 1))


class AppendFile:
    """A file of whole lines, each written with one `os.write` on an O_APPEND descriptor (a killed process
    leaves whole lines; processes sharing the file do not interleave), rotated past `max_bytes`. A write
    error (a full disk) logs one warning naming the file and the cause and stops the file, never the caller.
    `close` releases the descriptor only: a later `write` opens the file again and appends."""

    def __init__(self, path: Path, max_bytes: int, keep: int, what: str) -> None:
        self.path, self.max_bytes, self.keep, self.what = path, max_bytes, keep, what
        self.failed: Optional[str] = None
        self._fd: Optional[int] = None
        self._open()

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as error:
            self._fail(error)

    def write(self, line: bytes) -> None:
        if self._fd is None:
            if self.failed is not None:
                return
            self._open()  # closed at the end of one `train` call: the next call's steps go on appending
            if self._fd is None:
                return
        try:
            os.write(self._fd, line)
            if os.fstat(self._fd).st_size >= self.max_bytes:
                try:  # processes sharing the file: only the first to find it full rotates it
                    mine = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
                except FileNotFoundError:
                    mine = False
                if mine:
                    rotate(self.path, self.keep)
                self.close()
                self._open()
        except OSError as error:
            self._fail(error)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def _fail(self, error: OSError) -> None:
        self.failed = f"{error.strerror or error}"
        logger.warning("%s %s: %s; it stops being written, training goes on (free space, or drop the option)",
                       self.what, self.path, self.failed)
        self.close()
