"""Data preparation overlaps stage 0's compute in a pipeline run (workers)."""
from __future__ import annotations

from pathlib import Path

import pytest

from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.observe.tracing import read_trace
from support.images import image_folder


@pytest.mark.slow
def test_data_preparation_overlaps_stage0_compute_in_a_pipeline_run(tmp_path: Path):
    """By the order of trace events, not by timing: stage 0's batch of step s+1 starts being prepared
    (on the prefetch thread) before stage 0's last compute of step s has ended."""
    image_folder(tmp_path / "images")
    steps, micro = 4, 2
    result = launch_workers(["--model", "resnet18", "--data", str(tmp_path / "images"), "--steps", str(steps),
                             "--batch_size", "4", "--num_microbatches", str(micro), "--trace_dir", str(tmp_path / "trace"),
                             "--timeout", "60"], 2, timeout=300)
    assert result.ok, result.summary()
    events = read_trace(tmp_path / "trace" / "rank0.json")["traceEvents"]  # streamed: a JSON array
    prepare = {e["args"]["step"]: e for e in events if e.get("name") == "prepare"}
    compute = sorted((e for e in events if e.get("cat") == "compute"), key=lambda e: e["ts"])
    assert set(range(steps)) <= set(prepare)  # (steps after the last may be prepared too, then dropped)
    assert len(compute) == 2 * micro * steps  # a forward and a backward per microbatch on stage 0
    for step in range(steps - 1):
        last_compute = compute[(step + 1) * 2 * micro - 1]
        assert prepare[step + 1]["ts"] < last_compute["ts"] + last_compute["dur"], step
    waits = [e for e in events if e.get("name") == "data wait"]
    assert [e["args"]["step"] for e in waits] == list(range(steps))
