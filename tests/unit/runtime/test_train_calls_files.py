"""`PipelineTrainer.train(k)` in a loop (each call runs the engine's loop, which closes its files at the end): before,
the metrics JSONL stopped after the first call (its descriptor closed, later lines dropped without a word: 20 lines
after 2,500 steps of train(20) calls), and each call opened the trace chunk afresh (`rank0.json` held the last call's
events only). Every call's steps are in both files now, the trace still one valid chunk."""
from __future__ import annotations

from pathlib import Path

from model_parallel.runtime.config import RunOptions
from model_parallel.runtime.observe.metrics_read import read_metrics
from model_parallel.runtime.observe.tracing import read_trace
from tests.support.one_rank import mlp_engine, one_rank_world

CALLS, K = 4, 3


def _train_in_calls(tmp_path: Path, **options) -> None:
    with one_rank_world(tmp_path):
        engine = mlp_engine(RunOptions(progress=False, **options))
        for call in range(CALLS):
            engine.train(K * (call + 1), K * call)
        engine.metrics.close()


def test_every_call_s_steps_reach_the_metrics_file(tmp_path) -> None:
    _train_in_calls(tmp_path, metrics=str(tmp_path / "metrics" / "rank{rank}.jsonl"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics")] == list(range(CALLS * K))


def test_every_call_s_steps_reach_the_trace(tmp_path) -> None:
    _train_in_calls(tmp_path, trace_dir=str(tmp_path / "traces"))
    events = read_trace(tmp_path / "traces" / "rank0.json")["traceEvents"]
    assert sum(e.get("name") == "optimizer" for e in events) == CALLS * K  # one optimizer span a step
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["rank0.json"]  # one chunk, no rotation


def test_a_closed_chunk_changed_since_is_kept_not_overwritten(tmp_path) -> None:
    from model_parallel.runtime.observe.trace_stream import TraceStream

    meta = lambda: [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}}]  # noqa: E731
    stream = TraceStream(tmp_path / "rank0.json", meta)
    stream.write([{"ph": "X", "name": "first", "pid": 0, "ts": 0, "dur": 1}])
    stream.close()
    with open(tmp_path / "rank0.json", "a") as handle:  # someone appended to it: it cannot be continued
        handle.write(" ")
    stream.write([{"ph": "X", "name": "second", "pid": 0, "ts": 2, "dur": 1}])
    stream.close()
    names = lambda path: [e.get("name") for e in read_trace(path)["traceEvents"]]  # noqa: E731
    assert "first" in names(tmp_path / "rank0.1.json") and "second" in names(tmp_path / "rank0.json")
