"""bench/runtime.py's arithmetic: the ideal step behind `efficiency`, and how rounds and chunks combine."""
from __future__ import annotations

import importlib.util
import sys

import pytest
from support import REPO

BENCH = REPO / "bench"


def _load_bench_runtime():
    """bench/runtime.py as a module; its sibling bench/runtime_worlds.py is found on the path only while
    it loads (bench/ also holds profiler.py, models.py ...: names no other test should import from there)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_runtime", BENCH / "runtime.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


bench_runtime = _load_bench_runtime()


def test_ideal_step_is_the_pipeline_or_the_cores_whichever_is_longer() -> None:
    # 4 stages of 10 ms, 4 microbatches: (4 + 4 - 1) x 10 = 70 ms with a core per stage ...
    assert bench_runtime.ideal_step_s([10.0, 10.0, 10.0, 10.0], 4) == pytest.approx(0.070)
    assert bench_runtime.ideal_step_s([10.0, 10.0, 10.0, 10.0], 4, cores=4) == pytest.approx(0.070)
    # ... but 160 ms of work on 2 cores takes at least 80 ms
    assert bench_runtime.ideal_step_s([10.0, 10.0, 10.0, 10.0], 4, cores=2) == pytest.approx(0.080)
    # the slowest stage sets the pipeline bound
    assert bench_runtime.ideal_step_s([5.0, 20.0], 4, cores=2) == pytest.approx(0.100)


def _world(torch_chunks: list[float], ours_chunks: list[float], stage_ms: list[float]) -> dict:
    side = lambda chunks: {"step_s": sorted(chunks)[len(chunks) // 2], "chunk_step_s": chunks}  # noqa: E731
    return {"stage_ms": stage_ms, "schedules": {"1f1b": {"torch": side(torch_chunks), "ours": side(ours_chunks)}}}


def test_ratio_is_the_median_of_chunk_pairs_over_rounds() -> None:
    # Round 1 ran on a fast machine, round 2 on one twice as slow: pairs timed back to back still
    # compare like with like (torch / ours = 1.1 in every pair), although the medians of the two
    # sides' chunk times mix the two machines.
    fast = _world([0.110, 0.110], [0.100, 0.100], [9.0, 12.0])
    slow = _world([0.220, 0.220], [0.200, 0.200], [8.0, 15.0])
    combined = bench_runtime.combine_rounds([fast, slow])
    row = combined["schedules"]["1f1b"]
    assert row["ratio"] == pytest.approx(1.1)
    assert row["chunk_ratios"] == pytest.approx([1.1, 1.1, 1.1, 1.1])
    assert row["ours"]["step_s"] == pytest.approx(0.150)  # the median of all four chunks
    assert row["ours"]["step_s_rounds"] == pytest.approx([0.100, 0.200])
    assert combined["stage_ms"] == [8.0, 12.0]  # best per stage over the rounds


def test_one_side_only_has_no_ratio() -> None:
    world = {"stage_ms": [1.0], "schedules": {"gpipe": {"ours": {"step_s": 0.1, "chunk_step_s": [0.1, 0.1]}}}}
    row = bench_runtime.combine_rounds([world])["schedules"]["gpipe"]
    assert "ratio" not in row and row["ours"]["step_s"] == pytest.approx(0.1)
