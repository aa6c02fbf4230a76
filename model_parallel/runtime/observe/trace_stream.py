"""A rank's trace written as it runs, in bounded chunk files with rotation; a full disk only stops the trace.

    trace_dir/rank0.json     the current chunk (newest events), Chrome's JSON Array Format
    trace_dir/rank0.1.json   the chunk before it, closed; ... rank0.<keep>.json the oldest kept

Each chunk starts with `[` and the metadata naming the process and its lanes, then one event per line,
each after a `,` separator, so a chunk is a valid trace at every moment: the viewers (Perfetto,
chrome://tracing) accept a JSON array without its closing `]`, which a killed process never writes,
and `read_events` appends it. A rank loses at most the events of its last `flush_events` (kept in
memory) when it is killed. Once a chunk reaches `chunk_bytes` it is closed and renamed `.1`, older
ones shift up and the one past `keep` is deleted: a rank's trace takes at most `(keep + 1) *
chunk_bytes` on disk, however long it runs.

An OSError while writing (a full disk, a removed directory) logs one warning naming the file and the
cause, and the trace stops; training goes on.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

from model_parallel import jsonbound
from model_parallel.errors import LogFormatError
from model_parallel.jsonbound import MAX_FILE_BYTES
from model_parallel.runtime.observe.rotation import rotate
from model_parallel.userfile import read_text

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
FLUSH_EVENTS = 2000  # events kept in memory between writes (about 400 KB)
CHUNK_BYTES = 32 << 20  # a chunk file this large is closed and rotated
KEEP_CHUNKS = 4  # closed chunks kept besides the current one
CLOSING = "\n]\n"  # what `close` ends a chunk with (events and metadata are ASCII: json.dumps escapes the rest)


class TraceStream:
    """Appends events to the current chunk file; rotates it at `chunk_bytes`."""

    def __init__(self, path: PathLike, metadata: Callable[[], list[dict[str, Any]]], chunk_bytes: int = CHUNK_BYTES,
                 keep: int = KEEP_CHUNKS) -> None:
        self.path = Path(path)
        self.metadata = metadata  # the process and lane names, written at the head of each chunk
        self.chunk_bytes, self.keep = chunk_bytes, keep
        self.failed: Optional[str] = None  # why the trace stopped (a write error), None while it works
        self._file: Any = None
        self._written_meta: Optional[str] = None
        self._size = 0
        self._opened = 0  # chunk files opened so far
        self._closed_at: Optional[int] = None  # the current chunk's size before `close` wrote its "]": reopened there

    def write(self, events: list[dict[str, Any]]) -> None:
        """Append `events` (and the metadata when it changed: a plan switch gives a new stage or lane)."""
        if self.failed is not None:
            return
        try:
            if self._file is None:
                self._open()
            meta = self.metadata()
            text = json.dumps(meta)
            if text != self._written_meta:  # later metadata events override earlier ones in the viewers
                events = meta + events
                self._written_meta = text
            data = "".join(",\n" + json.dumps(e) for e in events)
            self._file.write(data)
            self._file.flush()
            self._size += len(data)
            if self._size >= self.chunk_bytes:
                self._rotate()
        except OSError as error:
            self._fail(error)

    def close(self) -> None:
        """Close the current chunk with its `]` (the file is a trace without it too)."""
        if self._file is None:
            return
        try:
            self._file.write(CLOSING)
            self._file.close()
            self._closed_at = self._size
        except OSError as error:
            self._fail(error)
        self._file = None

    def _open(self) -> None:
        closed_at, self._closed_at = self._closed_at, None
        if closed_at is not None:  # the chunk an earlier `train` call of this engine closed
            if self._reopen(closed_at):
                return
            rotate(self.path, self.keep)  # changed since: kept as `.1`, never overwritten by the new chunk
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._opened == 0:  # chunks of an earlier run into this directory would merge into this one's
            stale = re.compile(rf"{re.escape(self.path.stem)}\.\d+{re.escape(self.path.suffix)}$")
            for old in self.path.parent.iterdir():
                if stale.match(old.name):
                    old.unlink(missing_ok=True)
        self._opened += 1
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - kept open across writes
        # The process name first, so every later event (and the full metadata) follows a "," separator.
        head = "[" + json.dumps(self.metadata()[0])
        self._file.write(head)
        self._size = len(head)
        self._written_meta = None

    def _reopen(self, closed_at: int) -> bool:
        """Continue the chunk `close` ended at `closed_at` bytes (the next `train` call of the same engine): its "]"
        cut off again. Before, the chunk was opened afresh, so a loop of `train(k)` calls kept only the last call's
        events. False where the file is no longer what `close` left (its OSError, if any, is the write's to report)."""
        if not self.path.is_file() or self.path.stat().st_size != closed_at + len(CLOSING):
            return False
        self._file = open(self.path, "r+", encoding="utf-8")  # noqa: SIM115 - kept open across writes
        self._file.truncate(closed_at)
        self._file.seek(closed_at)
        self._size = closed_at
        return True

    def _rotate(self) -> None:
        self.close()
        self._closed_at = None  # the closed chunk is `.1` now
        rotate(self.path, self.keep)

    def _fail(self, error: OSError) -> None:
        self.failed = f"{error.strerror or error}"
        logger.warning("trace file %s: %s; tracing stops here, training goes on (free space or drop --trace_dir)",
                       self.path, self.failed)
        try:
            if self._file is not None:
                self._file.close()
        except OSError:
            pass
        self._file = None


def read_events(path: PathLike) -> Any:
    """The JSON of a trace file: an object (`{"traceEvents": [...]}`) or a JSON Array Format chunk, whose
    missing closing `]` (a process killed mid-run) is tolerated. LogFormatError (file:line) if it is neither."""
    text = read_text(path, error=LogFormatError, what="trace file", max_bytes=MAX_FILE_BYTES).strip()

    def decode(candidate: str) -> Any:  # bounded: deep nesting or a 5000-digit number is this error, no traceback
        return jsonbound.loads(candidate, where=str(path), error=LogFormatError, allow_nan=True,
                               fix="give a trace file a run wrote (--trace_dir)")
    try:
        return decode(text)
    except LogFormatError as error:
        if not text.startswith("["):
            raise
        first = error
    # An unclosed array: close it, or first cut a half-written last event (each event follows ",\n").
    for candidate in (text + "]", text.rsplit(",\n", 1)[0] + "]"):
        try:
            return decode(candidate)
        except LogFormatError:
            continue
    raise first  # neither closes it: the defect of the file as written (file:line)
