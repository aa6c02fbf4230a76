"""Per-step metrics: time each action by kind, write one JSONL line per rank per step (read back: metrics_read.py).

API (stable; the worker loop feeds it, the demo and the rebalance benchmark read it):

    recorder = MetricsRecorder(rank, path="run/metrics/rank{rank}.jsonl", stage=0, tracer=tracer)
    recorder.begin_step(step)
    with recorder.measure("forward", microbatch=3):   # times it; also a tracer span when a tracer is given
        ...
    recorder.add("send", seconds)                     # a duration measured elsewhere
    recorder.add_before_step("migration", seconds)    # a pause between the last step and this one
    record = recorder.end_step(samples=64, loss=2.3)  # -> StepRecord, appended to the JSONL file
    recorder.set_context(stage=1, plan_version=2)     # after a plan switch
    recorder.close()

    # reading them back: metrics_read.py (read_metrics, read_events, summarize, throughput, format_summary)

Kinds and how they add up (each action is timed once on the rank's main thread):

    compute_ms = forward + backward + recompute + optimizer
    comm_ms    = send + recv + allreduce + control + migration   (time *blocked* in communication)
    idle_ms    = step_ms - compute_ms - comm_ms                   (bubbles, data loading, Python overhead)

`step_ms` runs from begin_step to end_step. `samples` is the number of samples the whole pipeline
trained in the step (the global minibatch), so `samples_per_s = samples / step_ms` is the same kind
of number on every rank and the slowest rank's value is the pipeline's throughput.

A JSONL line is written with one `os.write` on a file opened for appending and is flushed at once:
a killed process leaves whole lines (the reader skips a cut-off last line), and several ranks may
share one file. `{rank}` in the path is replaced by the rank. Past 64 MB a file is rotated
(`rank0.jsonl` -> `rank0.1.jsonl`, ..., 4 kept; a directory read takes them all); a write error (a
full disk) logs one warning naming the file and stops the file, never the run.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from model_parallel.messages import StepReport
from model_parallel.runtime.observe.rotation import AppendFile

logger = logging.getLogger(__name__)

COMPUTE_KINDS = ("forward", "backward", "recompute", "optimizer")
COMM_KINDS = ("send", "recv", "allreduce", "control", "migration")
KINDS = COMPUTE_KINDS + COMM_KINDS
# Trace lane of each kind (see model_parallel.runtime.observe.tracing.LANES).
LANE_OF_KIND = {
    "forward": "compute",
    "backward": "compute",
    "recompute": "compute",
    "optimizer": "optimizer",
    "send": "send",
    "recv": "recv",
    "allreduce": "allreduce",
    "control": "control",
    "migration": "migration",
}
PathLike = Union[str, "os.PathLike[str]"]
# Records kept in memory: the latest steps (about 1.5 KB each; the JSONL files keep every step up to
# about (KEEP_FILES + 1) * MAX_FILE_BYTES: some 600,000 steps of one rank).
RECORD_WINDOW = 1000
MAX_FILE_BYTES = 64 << 20  # a metrics file this large is rotated
KEEP_FILES = 4  # rotated files kept besides the current one


@dataclass(frozen=True)
class StepRecord:
    """One rank's timings for one step (milliseconds), as written to the JSONL file."""

    step: int
    rank: int
    stage: Optional[int]
    plan_version: int
    samples: int
    samples_per_s: float
    step_ms: float
    compute_ms: float
    comm_ms: float
    idle_ms: float
    forward_ms: float
    backward_ms: float
    recompute_ms: float
    optimizer_ms: float
    send_ms: float
    recv_ms: float
    allreduce_ms: float
    control_ms: float
    migration_ms: float
    microbatches: int
    time: float  # unix time at the end of the step
    # CPU time of the whole process (all its threads) during the step: what the rank did, without the
    # time it waited on a peer or was descheduled (more ranks than cores, a loaded machine).
    cpu_ms: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)  # e.g. loss, lr

    def to_dict(self) -> dict[str, Any]:
        """Flat dict: the fields, then `extra`'s keys (which may not shadow a field)."""
        data = asdict(self)
        extra = data.pop("extra")
        data.update({k: v for k, v in extra.items() if k not in data})
        return data

    def to_report(self) -> StepReport:
        """What a `ControlChannel.report` takes (model_parallel/messages.py): the same milliseconds, and the loss
        from `extra` (None unless finite: the wire carries finite numbers only, this record keeps the NaN)."""
        loss = self.extra.get("loss")
        wire_loss = None
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
            wire_loss = float(loss)
        return StepReport(rank=self.rank, step=self.step, plan_version=self.plan_version, stage=self.stage,
                          step_ms=self.step_ms, compute_ms=self.compute_ms, comm_ms=self.comm_ms, idle_ms=self.idle_ms,
                          samples_per_s=self.samples_per_s, loss=wire_loss)


class _Measure:
    __slots__ = ("recorder", "kind", "span", "start")

    def __init__(self, recorder: "MetricsRecorder", kind: str, span: Any) -> None:
        self.recorder, self.kind, self.span = recorder, kind, span

    def __enter__(self) -> "_Measure":
        if self.span is not None:
            self.span.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.recorder._totals[self.kind] += time.perf_counter() - self.start
        if self.kind == "forward":
            self.recorder._microbatches += 1
        if self.span is not None:
            self.span.__exit__(*exc)


class MetricsRecorder:
    """Accumulates one rank's time per kind during a step; `end_step` emits the StepRecord."""

    def __init__(
        self,
        rank: int,
        path: Optional[PathLike] = None,
        stage: Optional[int] = None,
        plan_version: int = 0,
        tracer: Any = None,
        window: Optional[int] = None,
        max_bytes: int = MAX_FILE_BYTES,
        keep: int = KEEP_FILES,
    ) -> None:
        self.rank = rank
        self.stage = stage
        self.stages: tuple[int, ...] = ()  # all the rank holds when several (interleaved, zbv): the `stages` field
        self.plan_version = plan_version
        self.tracer = tracer
        self.path = Path(str(path).replace("{rank}", str(rank))) if path is not None else None
        # None without a path; its `failed` says why it stopped (a write error), None while it works.
        self.file = AppendFile(self.path, max_bytes, keep, f"rank {rank}: metrics file") if self.path is not None else None
        self._step: Optional[int] = None
        self._start = 0.0
        self._cpu_start = 0.0
        self._totals: dict[str, float] = defaultdict(float)
        self._microbatches = 0
        # The last `window` records, also in memory (for the control channel, benchmarks and tests).
        self.records: deque[StepRecord] = deque(maxlen=RECORD_WINDOW if window is None else window)

    def set_context(self, stage: Optional[int], plan_version: Optional[int] = None,
                    stages: Optional[Sequence[int]] = None) -> None:
        """`stages`: all the rank holds (its records' `stages` and its tracer's process name), `stage` the first."""
        self.stage = stage
        self.stages = tuple(stages or ())
        if plan_version is not None:
            self.plan_version = plan_version
        if self.tracer is not None:
            self.tracer.set_context(stage=stage, plan_version=plan_version, stages=stages)

    def begin_step(self, step: int) -> None:
        self._step = step
        self._totals = defaultdict(float)
        self._microbatches = 0
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()

    def _check_kind(self, kind: str) -> None:
        if kind not in LANE_OF_KIND:
            raise ValueError(f"unknown metrics kind {kind!r}; expected one of {KINDS}")

    def measure(self, kind: str, microbatch: Optional[int] = None, span: Optional[str] = None,
                **trace_args: Any) -> _Measure:
        """Time the body as `kind`; with a tracer, also a span on the kind's lane, named `span` (default: the kind)."""
        lane = LANE_OF_KIND.get(kind)
        if lane is None:
            self._check_kind(kind)
        tracer = self.tracer
        traced = None
        # Several measures per microbatch: a tracer that records nothing gets no span object at all.
        if tracer is not None and (tracer.enabled or tracer.annotate):
            traced = tracer.span(span or kind, lane=lane, microbatch=microbatch, **trace_args)
        return _Measure(self, kind, traced)

    def add(self, kind: str, seconds: float) -> None:
        """Count `seconds` as `kind` (a duration measured by the caller)."""
        self._check_kind(kind)
        self._totals[kind] += seconds

    def add_before_step(self, kind: str, seconds: float) -> None:
        """Count `seconds` spent just before this step began (a plan switch's pause, between two steps) as
        `kind` *and* in this step's time, which then starts that much earlier: counted in `kind` alone,
        the pause would make `idle_ms` negative at the switch step."""
        self.add(kind, seconds)
        self._start -= seconds

    def end_step(self, samples: int, **extra: Any) -> StepRecord:
        """Close the step, append its JSONL line (flushed) and return the record."""
        if self._step is None:
            raise ValueError(f"rank {self.rank}: end_step() without begin_step()")
        step_s = time.perf_counter() - self._start
        totals = self._totals
        compute = sum(totals[k] for k in COMPUTE_KINDS)
        comm = sum(totals[k] for k in COMM_KINDS)
        ms = {k: totals[k] * 1000.0 for k in KINDS}
        record = StepRecord(
            step=self._step,
            rank=self.rank,
            stage=self.stage,
            plan_version=self.plan_version,
            samples=int(samples),
            samples_per_s=samples / step_s if step_s > 0 else 0.0,
            step_ms=step_s * 1000.0,
            compute_ms=compute * 1000.0,
            comm_ms=comm * 1000.0,
            idle_ms=(step_s - compute - comm) * 1000.0,
            forward_ms=ms["forward"],
            backward_ms=ms["backward"],
            recompute_ms=ms["recompute"],
            optimizer_ms=ms["optimizer"],
            send_ms=ms["send"],
            recv_ms=ms["recv"],
            allreduce_ms=ms["allreduce"],
            control_ms=ms["control"],
            migration_ms=ms["migration"],
            microbatches=self._microbatches,
            time=time.time(),
            cpu_ms=(time.process_time() - self._cpu_start) * 1000.0,
            # `stage` is the first of a rank's stages; a reader told them apart from one stage only by this.
            extra={**extra, **({"stages": list(self.stages)} if len(self.stages) > 1 else {})},
        )
        self._step = None
        self.records.append(record)
        if self.file is not None:
            self.file.write((json.dumps(record.to_dict()) + "\n").encode())
        return record

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> "MetricsRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class StepLog:
    """Which steps get the per-step INFO line (`step N loss L`): every one of the first `first` steps of a
    run, then at most one per `interval_s` seconds and the last, so a long run's log stays bounded (about
    8,600 lines a day) while a short one, and any test waiting for step 5, still sees every step."""

    DEFAULT_INTERVAL_S = 10.0  # also how often a progress bar into a log file is redrawn (runtime/step/loop.py)

    def __init__(self, start_step: int, last_step: int, first: int = 100, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.start, self.last, self.first, self.interval_s = start_step, last_step, first, interval_s
        self._next_s = 0.0

    def due(self, step: int) -> bool:
        now = time.monotonic()
        if step - self.start < self.first or step == self.last or now >= self._next_s:
            self._next_s = now + self.interval_s
            return True
        return False


def busy_ms(record: Any) -> float:
    """A rank's milliseconds in a step not spent blocked on a peer: compute (forward, backward, loss,
    optimizer) + sends + idle (Python, data wait); receives and the step-end all-reduce are waits."""
    get: Callable[[str], Any] = record.get if isinstance(record, Mapping) else lambda key: getattr(record, key)
    return float(get("compute_ms")) + float(get("send_ms")) + float(get("idle_ms"))


def measured_ms(record: Any, clock: str) -> float:
    """A step record's counterpart of a prediction on `clock`: its `cpu_ms` ("cpu") or `busy_ms` ("wall")."""
    if clock == "cpu":  # NaN (shown as n/a) for records written before steps carried their CPU time
        return float(record.get("cpu_ms", math.nan) if isinstance(record, Mapping) else record.cpu_ms)
    return busy_ms(record)
