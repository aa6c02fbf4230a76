"""Reading a file a user named: a regular file within a size cap, or one error of the caller's type.

The one owner of the rule "never open what could block or never end". Opening a FIFO waits for a
writer forever, a device such as /dev/zero never reaches end of file (the read grows until a raw
MemoryError), and a directory fails deep in a parser. Every reader of a path the user gave goes
through here (or through `jsonbound.load_file`, which does), so each refuses those the same way:
the path, what it is instead, and what to give.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]
_PIECE = 1 << 20


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "an unknown kind"


def _refuse(where: str, mode: int, error: type[Exception], what: str, suffix: str) -> Exception:
    return error(f"{where}: not a regular file ({_kind(mode)}, possibly behind a symlink); it was not read; "
                 f"give the {what} itself{suffix}")


def check_regular(path: PathLike, *, error: type[Exception], what: str = "file", fix: str = "",
                  where: str = "") -> int:
    """The size of `path` if it is a regular file (symlinks followed); else `error` naming it (or `where`). For
    readers that must open the file themselves (a library's own open); the others use `read_bytes`/`read_text`."""
    suffix, where = (f"; {fix}" if fix else ""), where or str(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise error(f"{where}: cannot read {what}: {exc.strerror or exc}{suffix}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(where, info.st_mode, error, what, suffix)
    return info.st_size


def read_bytes(path: PathLike, *, error: type[Exception], what: str = "file", max_bytes: int, fix: str = "") -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them; anything else is `error` naming it."""
    suffix = f"; {fix}" if fix else ""
    too_big = f"is more than the {max_bytes} bytes accepted for a {what}{suffix}"
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked on the open descriptor
        # (no window for a swap between a stat and the open).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}{suffix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(str(path), info.st_mode, error, what, suffix)
        if info.st_size > max_bytes:
            raise error(f"{path}: {info.st_size} bytes {too_big}")
        os.set_blocking(fd, True)
        # Read to the cap and one byte past it, not to the size stat gave: /proc files say 0 and a file may grow.
        pieces, total = [], 0
        while True:
            piece = os.read(fd, min(_PIECE, max_bytes + 1 - total))
            if not piece:
                break
            pieces.append(piece)
            total += len(piece)
            if total > max_bytes:
                raise error(f"{path}: {too_big}")
        return b"".join(pieces)
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}{suffix}") from None
    finally:
        os.close(fd)


def decode(data: bytes, where: str, *, error: type[Exception], what: str = "file", fix: str = "") -> str:
    """UTF-8 text of `data`; a bad byte is `error` naming where, its line and byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        suffix = f"; {fix}" if fix else ""
        raise error(f"{where}:{line}: not a text file (the {what} is not UTF-8: {exc.reason} at byte {exc.start})"
                    f"{suffix}") from None


def read_text(path: PathLike, *, error: type[Exception], what: str = "file", max_bytes: int, fix: str = "") -> str:
    """`read_bytes` decoded as UTF-8 (see `decode`)."""
    return decode(read_bytes(path, error=error, what=what, max_bytes=max_bytes, fix=fix), str(Path(path)),
                  error=error, what=what, fix=fix)
