"""Observability is never fatal nor unbounded: a trace streams to rotated chunk files (each a valid Chrome
trace, also when the process is killed before the end), metrics files rotate, and a full disk under either
stops only that output, with one warning naming the file."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from model_parallel.runtime.observe.metrics import MetricsRecorder

from model_parallel.runtime.observe.metrics_read import read_metrics
from model_parallel.runtime.observe.tracing import Tracer, merge_traces, read_trace

FULL = Path("/dev/full")  # every write fails with ENOSPC, as on a full disk
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")


def record(tracer: Tracer, count: int) -> None:
    for number in range(count):
        start = tracer.now_ns()
        tracer.add("forward", "compute", start, start + 1000, microbatch=number % 4, step=number)


def test_a_streamed_trace_is_chunked_rotated_and_every_chunk_is_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "rank0.json"
    (tmp_path / "rank0.7.json").write_text("[]")  # left by an earlier run's longer trace: not part of this one
    (tmp_path / "rank0.2.json").write_text("[]")
    tracer = Tracer(0, stage=0, stream=path, flush_events=50, chunk_bytes=20_000, keep_chunks=2, nvtx=False)
    record(tracer, 2000)
    tracer.save(path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rank0.1.json", "rank0.2.json", "rank0.json"]  # the oldest chunks were deleted
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) < 3 * 20_000 + 50 * 300
    steps = []
    for name in files:
        events = json.loads((tmp_path / name).read_text())  # closed: plain JSON arrays
        assert any(e["name"] == "process_name" and e["args"]["name"] == "rank 0 (stage 0)" for e in events)
        steps += [e["args"]["step"] for e in events if e["ph"] == "X"]
    assert max(steps) == 1999 and len(steps) == len(set(steps)) < 2000  # the newest kept, the oldest rotated out
    assert len(tracer.events) == 0  # nothing accumulates in memory
    merged = read_trace(merge_traces([tmp_path / n for n in files], tmp_path / "all.json"))
    assert len([e for e in merged["traceEvents"] if e["ph"] == "X"]) == len(steps)


def test_a_killed_run_leaves_a_readable_trace_of_what_was_flushed(tmp_path: Path) -> None:
    path = tmp_path / "rank1.json"
    tracer = Tracer(1, stage=1, stream=path, flush_events=10, nvtx=False)
    record(tracer, 35)  # never saved: as after kill -9, the file has no closing bracket
    text = path.read_text()
    assert text.startswith("[") and not text.rstrip().endswith("]")
    events = read_trace(path)["traceEvents"]
    assert [e["args"]["step"] for e in events if e["ph"] == "X"] == list(range(30))
    with open(path, "a") as f:
        f.write(',\n{"name": "forw')  # killed in the middle of a write
    assert len([e for e in read_trace(path)["traceEvents"] if e["ph"] == "X"]) == 30


def test_the_merge_command_takes_a_directory_of_chunks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from model_parallel.cli.tracing import main

    for rank in range(2):
        tracer = Tracer(rank, stage=rank, stream=tmp_path / f"rank{rank}.json", flush_events=20, chunk_bytes=5_000,
                        nvtx=False)
        record(tracer, 100)
        if rank == 0:
            tracer.save(tmp_path / "rank0.json")  # rank 1 was killed: its current chunk is unclosed
    assert main([str(tmp_path / "all.json"), str(tmp_path)]) == 0
    events = read_trace(tmp_path / "all.json")["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


@needs_dev_full
def test_a_full_disk_stops_the_trace_with_one_warning_not_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rank0.json"
    path.symlink_to(FULL)
    tracer = Tracer(0, stage=0, stream=path, flush_events=10, nvtx=False)
    with caplog.at_level(logging.WARNING):
        record(tracer, 100)
        assert tracer.save(path) == path  # no exception at the end either
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "No space left on device" in warnings[0], warnings
    assert not tracer.enabled and tracer.events == []


@needs_dev_full
def test_a_full_disk_stops_the_metrics_file_with_one_warning_not_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rank0.jsonl"
    path.symlink_to(FULL)
    with caplog.at_level(logging.WARNING), MetricsRecorder(0, path=tmp_path / "rank{rank}.jsonl") as recorder:
        for step in range(5):
            recorder.begin_step(step)
            recorder.end_step(samples=8, loss=1.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "No space left on device" in warnings[0], warnings
    assert [r.step for r in recorder.records] == list(range(5))  # still measured, for the control channel


def test_metrics_files_rotate_and_a_directory_read_takes_them_all(tmp_path: Path) -> None:
    with MetricsRecorder(0, path=tmp_path / "rank{rank}.jsonl", max_bytes=4_000, keep=2) as recorder:
        for step in range(60):
            recorder.begin_step(step)
            recorder.end_step(samples=8, loss=1.0)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rank0.1.jsonl", "rank0.2.jsonl", "rank0.jsonl"]
    assert all(p.stat().st_size < 4_000 + 1_000 for p in tmp_path.iterdir())
    steps = sorted(r["step"] for r in read_metrics(tmp_path))
    assert steps == list(range(steps[0], 60)) and steps[0] > 0  # the newest kept, contiguous


@needs_dev_full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_on_a_full_disk_for_metrics_and_traces_train_on_and_exit_0(tmp_path: Path) -> None:
    from model_parallel.runtime.launch import launch_workers

    (tmp_path / "trace").mkdir()
    for rank in range(2):
        (tmp_path / f"rank{rank}.jsonl").symlink_to(FULL)
        (tmp_path / "trace" / f"rank{rank}.json").symlink_to(FULL)
    result = launch_workers(["--model", "mlp", "--steps", "3", "--batch_size", "8", "--num_microbatches", "4",
                             "--timeout", "30", "--metrics", str(tmp_path / "rank{rank}.jsonl"),
                             "--trace_dir", str(tmp_path / "trace")], 2, timeout=200)
    assert result.ok and [w.returncode for w in result.workers] == [0, 0], result.summary()
    for rank in range(2):
        output = result.output(rank)
        assert "Traceback" not in output and "done: 3 step(s)" in output, output[-3000:]
        assert f"metrics file {tmp_path / f'rank{rank}.jsonl'}: No space left on device" in output, output[-3000:]
        assert f"trace file {tmp_path / 'trace' / f'rank{rank}.json'}: No space left on device" in output, output[-3000:]


def test_the_per_step_log_line_is_bounded_after_the_first_steps() -> None:
    from model_parallel.runtime.observe.metrics import StepLog

    log = StepLog(start_step=5, last_step=20_004, first=100, interval_s=3600.0)
    due = [step for step in range(5, 20_005) if log.due(step)]
    assert due == list(range(5, 105)) + [20_004]  # the first 100, then (within the hour) only the last
