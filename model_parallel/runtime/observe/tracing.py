"""Per-rank Chrome/Perfetto trace JSON of pipeline actions, labelled for torch.profiler and Nsight too.

API (stable; the worker loop calls these):

    tracer = Tracer(rank, stage=0, plan_version=0, enabled=True)
    with tracer.span("forward", lane="compute", microbatch=3):      # also record_function / NVTX
        ...
    tracer.add("send", lane="send", start_ns=t0, end_ns=t1, microbatch=3)  # an already-timed span
    tracer.instant("switch to plan 2")                               # a marker on the timeline
    tracer.set_context(stage=1, plan_version=2)                      # after a plan switch
    tracer.save("traces/rank0.json")                                 # atomic write
    Tracer(rank, stream="traces/rank0.json")                         # written as it runs, in rotated
                                                                     # chunks (runtime/observe/trace_stream.py)
    merge_traces(["traces/rank0.json", "traces/rank1.json"], "traces/all.json")

Open the files in https://ui.perfetto.dev or chrome://tracing. One process per rank ("rank r (stage s)"),
one thread lane per activity: compute, send, recv, optimizer (then any other lane names used, such as
allreduce or migration). Complete events (`ph: "X"`) carry `ts`/`dur` in microseconds and `args`
{microbatch, stage, plan_version, ...}. Timestamps are wall-clock microseconds taken from a monotonic
clock anchored once per process, so files from several ranks (or hosts with synchronised clocks) line up.

Cost: a disabled tracer's `span()` returns one shared no-op context manager (tens of nanoseconds), so
the worker can call it unconditionally. `annotate` (default: same as `enabled`) controls the
`torch.profiler.record_function` / `torch.cuda.nvtx.range` labels, which can be kept on without a
JSON trace when running under torch.profiler or Nsight Systems.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch

from model_parallel.errors import LogFormatError
from model_parallel.fileio import atomic_write_json
from model_parallel.runtime.observe.trace_stream import CHUNK_BYTES, FLUSH_EVENTS, KEEP_CHUNKS, TraceStream, read_events

logger = logging.getLogger(__name__)

LANES = ("compute", "send", "recv", "optimizer")
DEFAULT_MAX_EVENTS = 2_000_000  # about 400 MB of JSON; beyond this spans are counted, not kept
PathLike = Union[str, "Path"]

_NULL = nullcontext()
_KEEP = object()  # set_context: leave the stage as it is


class _Clock:
    """Wall-clock microseconds read from perf_counter: monotonic within the process, comparable across ranks."""

    def __init__(self) -> None:
        self.wall_ns = time.time_ns()
        self.perf_ns = time.perf_counter_ns()

    def us(self, perf_ns: int) -> float:
        return (self.wall_ns + (perf_ns - self.perf_ns)) / 1000.0


class _Span:
    """Context manager for one span; records on exit (also when the body raises)."""

    __slots__ = ("tracer", "name", "lane", "args", "start", "labels")

    def __init__(self, tracer: "Tracer", name: str, lane: str, args: dict[str, Any]) -> None:
        self.tracer, self.name, self.lane, self.args = tracer, name, lane, args
        self.labels: list[Any] = []

    def __enter__(self) -> "_Span":
        tracer = self.tracer
        if tracer.annotate:
            label = tracer._label(self.name, self.args)
            record = torch.profiler.record_function(label)
            record.__enter__()
            self.labels.append(record)
            if tracer.nvtx:
                torch.cuda.nvtx.range_push(label)
                self.labels.append(None)  # marks the NVTX range to pop
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = time.perf_counter_ns()
        tracer = self.tracer
        if tracer.enabled:
            tracer.add(self.name, self.lane, self.start, end, **self.args)
        for label in reversed(self.labels):
            if label is None:
                torch.cuda.nvtx.range_pop()
            else:
                label.__exit__(None, None, None)


class Tracer:
    """Collects one rank's spans in memory; `save` writes them as Chrome trace JSON."""

    def __init__(
        self,
        rank: int,
        stage: Optional[int] = None,
        plan_version: int = 0,
        enabled: bool = True,
        annotate: Optional[bool] = None,
        nvtx: Optional[bool] = None,
        max_events: int = DEFAULT_MAX_EVENTS,
        stream: Optional[PathLike] = None,
        flush_events: int = FLUSH_EVENTS,
        chunk_bytes: int = CHUNK_BYTES,
        keep_chunks: int = KEEP_CHUNKS,
    ) -> None:
        self.rank = rank
        self.stage = stage
        self.plan_version = plan_version
        self.enabled = enabled
        self.annotate = enabled if annotate is None else annotate
        # NVTX ranges only mean something to Nsight on a CUDA machine.
        self.nvtx = self.annotate and (torch.cuda.is_available() if nvtx is None else nvtx)
        self.max_events = max_events
        self.dropped = 0
        self._clock = _Clock()
        self._events: list[dict[str, Any]] = []
        self._lanes: dict[str, int] = {lane: tid for tid, lane in enumerate(LANES)}
        # The process name's stage labels, in the order the rank ran them: "0,3" for a rank holding two stages.
        self._stages_seen: list[Optional[str]] = [None if stage is None else str(stage)]
        # Streaming (the worker's --trace_dir): events go to bounded, rotated chunk files as the run goes
        # (runtime/observe/trace_stream.py), so a long run neither grows memory nor loses its trace when killed.
        self.flush_events = flush_events
        # The prefetch thread records too: appending and flushing (swapping the buffer) must not interleave.
        self._lock = threading.Lock()
        self._stream = TraceStream(stream, self._metadata, chunk_bytes, keep_chunks) if stream and enabled else None

    # ------------------------------------------------------------------ recording

    def set_context(self, stage: Any = _KEEP, plan_version: Optional[int] = None,
                    stages: Optional[Sequence[int]] = None) -> None:
        """Change the stage (None: a spare) / plan version stamped on later spans (after a plan switch); `stages`: all
        the rank holds (interleaved, zbv), for the process name (it named a rank holding 0 and 3 "stage 0")."""
        if stage is not _KEEP:
            self.stage = stage
        if plan_version is not None:
            self.plan_version = plan_version
        label = ",".join(map(str, stages)) if stages else None if self.stage is None else str(self.stage)
        if label not in self._stages_seen:
            self._stages_seen.append(label)

    def span(self, name: str, lane: str = "compute", **args: Any) -> Any:
        """Context manager timing `name` on `lane`; keyword arguments go into the event's args."""
        if not (self.enabled or self.annotate):
            return _NULL
        return _Span(self, name, lane, args)

    def add_lane(self, lane: str) -> None:
        """Register `lane` now (from the recording thread's owner), before another thread records on it."""
        self._tid(lane)

    def now_ns(self) -> int:
        """The clock spans use (time.perf_counter_ns), for `add` with start/end measured by the caller."""
        return time.perf_counter_ns()

    def add(self, name: str, lane: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """Record a span measured by the caller with `now_ns()` (e.g. an isend and its wait)."""
        if not self.enabled:
            return
        if len(self._events) >= self.max_events:
            self.dropped += 1
            return
        event_args = {"stage": self.stage, "plan_version": self.plan_version}
        event_args.update(args)
        self._record({"name": name, "cat": lane, "ph": "X", "ts": self._clock.us(start_ns),
                      "dur": max(end_ns - start_ns, 0) / 1000.0, "pid": self.rank, "tid": self._tid(lane), "args": event_args})

    def _record(self, event: dict[str, Any]) -> None:
        if self._stream is None:
            self._events.append(event)  # one list append: safe across threads without a lock
            return
        with self._lock:
            self._events.append(event)
            if len(self._events) >= self.flush_events:
                self._flush_locked()

    def instant(self, name: str, **args: Any) -> None:
        """A process-wide marker (e.g. a plan switch or a checkpoint)."""
        if not self.enabled:
            return
        event_args = {"stage": self.stage, "plan_version": self.plan_version}
        event_args.update(args)
        self._record({"name": name, "ph": "i", "s": "p", "ts": self._clock.us(time.perf_counter_ns()), "pid": self.rank,
                      "tid": 0, "args": event_args})

    def _tid(self, lane: str) -> int:
        tid = self._lanes.get(lane)
        if tid is None:
            tid = self._lanes[lane] = len(self._lanes)
        return tid

    def _label(self, name: str, args: Mapping[str, Any]) -> str:
        microbatch = args.get("microbatch")
        stage = self.stage if args.get("stage") is None else args["stage"]
        label = f"{name} stage{stage}" if stage is not None else name
        return f"{label} mb{microbatch}" if microbatch is not None else label

    # ------------------------------------------------------------------ output

    @property
    def events(self) -> list[dict[str, Any]]:
        """The recorded events (without metadata), in recording order."""
        return list(self._events)

    def process_name(self) -> str:
        stages = [s for s in self._stages_seen if s is not None]
        if not stages:
            return f"rank {self.rank} (no stage)"
        return f"rank {self.rank} (stage {'->'.join(str(s) for s in stages)})"

    def _metadata(self) -> list[dict[str, Any]]:
        """The events naming the process (rank and stages) and its lanes, for the viewers."""
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": self.process_name()}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}},
        ]
        for lane, tid in self._lanes.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid, "args": {"sort_index": tid}})
        return meta

    def to_json(self) -> dict[str, Any]:
        """The Chrome trace object: metadata naming the process and lanes, then the events."""
        other = {"rank": self.rank, "dropped_events": self.dropped}
        return {"traceEvents": self._metadata() + self._events, "displayTimeUnit": "ms", "otherData": other}

    def flush(self) -> None:
        """Streaming: append the events held in memory to the current chunk file (a write error stops
        the trace with one warning, never the run)."""
        if self._stream is None:
            return
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        assert self._stream is not None
        self._stream.write(self._events)
        self._events = []
        if self._stream.failed is not None:
            self.enabled = False  # nothing more to record: the trace file cannot take it

    def save(self, path: PathLike) -> Path:
        """Write the trace atomically (a reader never sees half a file). Streaming to `path`: write what
        is left and close the chunk (never raises: a trace is not worth failing a run for)."""
        if self.dropped:
            logger.warning("rank %d: trace kept %d events and dropped %d (max_events)", self.rank, len(self._events), self.dropped)
        if self._stream is not None and Path(path) == self._stream.path:
            self.flush()
            self._stream.close()
            return Path(path)
        return atomic_write_json(path, self.to_json())


def read_trace(path: PathLike) -> dict[str, Any]:
    """Load a trace file written by `Tracer.save`, a streamed chunk (closed or not) or `merge_traces`, as
    `{"traceEvents": [...], ...}` (ValueError if it is not a trace)."""
    data = read_events(path)
    if isinstance(data, list) and data and all(isinstance(e, dict) and "ph" in e for e in data):
        data = {"traceEvents": data}  # a streamed chunk (JSON Array Format)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise LogFormatError(f"{path}: not a Chrome trace (expected an object with a 'traceEvents' list or a JSON array of events)")
    _check_events(data, str(path))
    return data


# The fields `merge_traces` computes with or sorts by, and the types Chrome's trace format gives them.
_EVENT_FIELDS = (("ts", (int, float), "a number"), ("dur", (int, float), "a number"), ("pid", int, "an integer"),
                 ("tid", (int, str), "an integer or a string"), ("ph", str, "a string"), ("name", str, "a string"))


def _check_events(data: dict[str, Any], where: str) -> None:
    """Each event is an object whose fields have their format's types (a "ts" of "x" or a "pid" of [] would be a
    TypeError while merging), and a finite time; the error names the file and the event."""
    fix = "give a trace file a run wrote (--trace_dir)"
    for index, event in enumerate(data["traceEvents"]):
        if not isinstance(event, dict):
            raise LogFormatError(f"{where}: traceEvents[{index}] must be an object, found {json.dumps(event)[:40]}; {fix}")
        for key, kinds, expected in _EVENT_FIELDS:
            value = event.get(key)
            if key in event and (isinstance(value, bool) or not isinstance(value, kinds)
                                 or (isinstance(value, float) and not math.isfinite(value))):
                raise LogFormatError(f"{where}: traceEvents[{index}].{key} must be {expected}, found "
                                     f"{json.dumps(value)[:40]}; {fix}")
    other = data.get("otherData", {})
    dropped = other.get("dropped_events", 0) if isinstance(other, dict) else None
    if isinstance(dropped, bool) or not isinstance(dropped, int):
        raise LogFormatError(f"{where}: otherData.dropped_events must be an integer; {fix}")


def merge_traces(paths: Iterable[PathLike], out: PathLike, rebase: bool = True) -> Path:
    """Combine per-rank trace files into one timeline (one process per rank), written atomically.

    `rebase` shifts every timestamp so the earliest event of all ranks is at 0, which keeps the
    numbers short in the viewer; relative timing between ranks is preserved.
    """
    events: list[dict[str, Any]] = []
    dropped = 0
    for path in paths:
        data = read_trace(path)
        if _is_merged(data):  # its ranks' events again, rebased to 0 beside raw clocks: every span twice, apart
            logger.warning("%s: skipped, a merged trace (merge the ranks' own files)", path)
            continue
        events.extend(data["traceEvents"])
        dropped += int(data.get("otherData", {}).get("dropped_events", 0))
    if rebase:
        timed = [e["ts"] for e in events if e.get("ph") != "M" and "ts" in e]
        origin = min(timed) if timed else 0.0
        for event in events:
            if event.get("ph") != "M" and "ts" in event:
                event["ts"] = event["ts"] - origin
    # Metadata first, then events in time order: some viewers draw faster on sorted input.
    meta = [e for e in events if e.get("ph") == "M"]
    timed_events = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: (e.get("ts", 0), e.get("pid", 0)))
    return atomic_write_json(out, {"traceEvents": meta + timed_events, "displayTimeUnit": "ms",
                                   "otherData": {"dropped_events": dropped, "merged": True}})


def _is_merged(data: Mapping[str, Any]) -> bool:
    """A `merge_traces` output: marked so, or (written before the mark) an object of several ranks' events without
    the `rank` a rank's own file (`Tracer.to_json`) records; a streamed chunk is an array of one rank's events."""
    other = data.get("otherData")
    if not isinstance(other, dict):
        return False
    return other.get("merged") is True or ("rank" not in other and len({e.get("pid") for e in data["traceEvents"]}) > 1)

