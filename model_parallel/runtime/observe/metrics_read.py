"""Reading per-step metrics back (the files `metrics.MetricsRecorder` writes) and summarising them:

    read_metrics(path) -> list[dict]       # a file, a directory of *.jsonl, or a list of them
    read_events(path, kind) -> list[dict]  # the event lines of a kind ("switch", "recovery", ...)
    summarize(records) -> list[dict]        # one row per step across ranks
    throughput(records, warmup=1) -> float  # samples/s over the steps after `warmup`
    format_summary(rows) -> str             # a plain-text table of `summarize` rows

A hostile or edited file is a `LogFormatError` naming file:line; a cut-off last line (a killed writer) is skipped.
"""
from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Union

from model_parallel import jsonbound
from model_parallel.errors import LogFormatError
from model_parallel.jsonbound import MAX_FILE_BYTES as MAX_READ_BYTES
from model_parallel.runtime.observe.metrics import StepRecord
from model_parallel.userfile import read_text

logger = logging.getLogger(__name__)
PathLike = Union[str, "os.PathLike[str]"]

def _metrics_files(path: Union[PathLike, Iterable[PathLike]]) -> list[Path]:
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        return sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    return [f for item in path for f in _metrics_files(item)]


def _json_lines(path: Union[PathLike, Iterable[PathLike]]) -> Iterator[tuple[Path, int, str, Any]]:
    """(file, line number, line, decoded JSON) of every line; a cut-off last line (a process killed
    mid-write) is skipped with a warning; a bad line elsewhere is a LogFormatError naming file:line."""
    for file in _metrics_files(path):
        lines = read_text(file, error=LogFormatError, what="metrics file", max_bytes=MAX_READ_BYTES).split("\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                # Bounded (depth, integer digits): a hostile line is this error, not a RecursionError.
                record = jsonbound.loads(line, where="line", error=LogFormatError, allow_nan=True)
            except LogFormatError as error:
                if number == len(lines):  # no newline after it: the writer was killed mid-line
                    logger.warning("%s:%d: skipping a cut-off last line", file, number)
                    continue
                detail = str(error).split(": ", 1)[-1]
                raise LogFormatError(f"{file}:{number}: not a JSON object ({detail}); was the file edited?") from None
            yield file, number, line, record


def read_metrics(path: Union[PathLike, Iterable[PathLike]]) -> list[dict[str, Any]]:
    """All step records of a JSONL file, of every *.jsonl in a directory, or of a list of either (events,
    such as the `{"event": "recovery", ...}` lines of `--recover`, are `read_events`')."""
    records: list[dict[str, Any]] = []
    for file, number, line, record in _json_lines(path):
        if isinstance(record, dict) and "event" in record:
            continue
        if not isinstance(record, dict) or "step" not in record or "rank" not in record:
            raise LogFormatError(f"{file}:{number}: expected a metrics record with 'step' and 'rank', found {line[:80]!r}")
        _check_types(record, f"{file}:{number}")
        records.append(record)
    return records


_INT_FIELDS = ("step", "rank", "plan_version", "samples", "microbatches")
_NUMBER_FIELDS = tuple(f.name for f in fields(StepRecord) if f.type == "float")


def _check_types(record: Mapping[str, Any], where: str) -> None:
    """The fields `summarize` computes with have the types a recorder writes (a step of "x" or a rank of [1]
    would be a TypeError deep in the summary); a NaN time is allowed (a recorder writes one)."""
    for key in _INT_FIELDS + ("stage",) + _NUMBER_FIELDS:
        value = record.get(key)
        if key not in record or (key == "stage" and value is None):
            continue
        integer = key in _INT_FIELDS or key == "stage"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise LogFormatError(f"{where}: {key!r} must be {'an integer' if integer else 'a number'}, found "
                                 f"{json.dumps(value)[:40]}; was the file edited?")
    stages = record.get("stages")
    if stages is not None and not (isinstance(stages, list) and 0 < len(stages) <= 64 and all(
            isinstance(s, int) and not isinstance(s, bool) for s in stages)):
        raise LogFormatError(f"{where}: 'stages' must be a list of stage numbers, found {json.dumps(stages)[:40]}; "
                             "was the file edited?")


def read_events(path: Union[PathLike, Iterable[PathLike]], kind: str) -> list[dict[str, Any]]:
    """The `{"event": kind, ...}` lines of the same files, in file order."""
    return [r for _, _, _, r in _json_lines(path) if isinstance(r, dict) and r.get("event") == kind]


def summarize(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per step across ranks: the pipeline's throughput and each stage's time split.

    Row: step, plan_version, ranks, samples, step_ms (slowest rank), samples_per_s (= samples / that),
    stages {stage: {compute_ms, comm_ms, idle_ms}} (mean over a stage's replicas), bottleneck_stage
    (most compute), labels {stage: "0,3"} (a rank holding several stages is keyed by its first). Spare ranks (stage None) are counted in `ranks` only. A rank's step recorded twice counts once,
    the later record: a run killed after its last checkpoint wrote the steps its resume trains again (the files
    are appended to), and both records were counted as replicas (twice the ranks, the timings of two runs blended).
    """
    latest = {(int(r["step"]), int(r["rank"])): r for r in records}  # in file order: the resume's record last
    by_step: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for record in latest.values():
        needed = ("step_ms",) + (("compute_ms", "comm_ms", "idle_ms") if record.get("stage") is not None else ())
        missing = [key for key in needed if key not in record]
        if missing:
            raise LogFormatError(f"the record of step {record.get('step')}, rank {record.get('rank')} has no {missing}; "
                                 "give the metrics files a run wrote")
        by_step[int(record["step"])].append(record)
    rows = []
    for step in sorted(by_step):
        group = by_step[step]
        step_ms = max(r["step_ms"] for r in group)
        samples = max(int(r.get("samples", 0)) for r in group)
        per_stage: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
        for r in group:
            if r.get("stage") is not None:
                per_stage[int(r["stage"])].append(r)
        stages = {
            stage: {key: sum(r[key] for r in rs) / len(rs) for key in ("compute_ms", "comm_ms", "idle_ms")}
            for stage, rs in sorted(per_stage.items())
        }
        labels = {stage: ",".join(map(str, rs[0].get("stages") or [stage])) for stage, rs in sorted(per_stage.items())}
        rows.append(
            {
                "step": step,
                "plan_version": max(int(r.get("plan_version", 0)) for r in group),
                "ranks": len(group),
                "samples": samples,
                "step_ms": step_ms,
                "samples_per_s": samples / (step_ms / 1000.0) if step_ms > 0 else 0.0,
                "stages": stages,
                "bottleneck_stage": max(stages, key=lambda s: stages[s]["compute_ms"]) if stages else None,
                "labels": labels,
            }
        )
    return rows


def throughput(records: Iterable[Mapping[str, Any]], warmup: int = 1) -> float:
    """Samples per second over all steps after the first `warmup` (total samples / total slowest-rank time)."""
    rows = summarize(records)[warmup:]
    total_ms = sum(r["step_ms"] for r in rows)
    return sum(r["samples"] for r in rows) / (total_ms / 1000.0) if total_ms > 0 else 0.0


def format_summary(rows: Iterable[Mapping[str, Any]]) -> str:
    """A plain-text table of `summarize` rows, for logs and command lines."""
    lines = [f"{'step':>5} {'plan':>4} {'step ms':>9} {'samples/s':>10}  per stage compute/comm/idle ms"]
    for row in rows:
        parts = " ".join(
            f"s{row.get('labels', {}).get(s, s)}:{v['compute_ms']:.1f}/{v['comm_ms']:.1f}/{v['idle_ms']:.1f}"
            for s, v in row["stages"].items()
        )
        lines.append(f"{row['step']:>5} {row['plan_version']:>4} {row['step_ms']:>9.1f} {row['samples_per_s']:>10.1f}  {parts}")
    return "\n".join(lines)
