"""Per-rank Chrome traces: well-formed events, lanes, labels for torch.profiler, merging ranks."""
from __future__ import annotations

import json
import time

import pytest
import torch

from model_parallel.runtime.observe.metrics import MetricsRecorder
from model_parallel.runtime.observe.tracing import LANES, Tracer, merge_traces, read_trace

torch.set_num_threads(1)


def _spans(rank: int, stage: int) -> Tracer:
    tracer = Tracer(rank, stage=stage, plan_version=1, nvtx=False)
    for microbatch in range(2):
        with tracer.span("forward", lane="compute", microbatch=microbatch):
            torch.ones(4).sum()
        start = tracer.now_ns()
        end = tracer.now_ns()
        tracer.add("send", "send", start, end, microbatch=microbatch, bytes=16)
    with tracer.span("allreduce", lane="allreduce"):
        pass
    tracer.instant("checkpoint", step=3)
    return tracer


def test_trace_json_is_well_formed(tmp_path):
    tracer = _spans(rank=1, stage=0)
    path = tracer.save(tmp_path / "rank1.json")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["forward", "send", "forward", "send", "allreduce"]
    for event in complete:
        assert event["pid"] == 1 and event["dur"] >= 0 and isinstance(event["ts"], float)
        assert event["args"]["stage"] == 0 and event["args"]["plan_version"] == 1
    assert complete[2]["args"]["microbatch"] == 1 and complete[1]["args"]["bytes"] == 16
    # Spans are in time order and the wall clock anchors them (within a minute of now).
    assert complete[0]["ts"] <= complete[1]["ts"] <= complete[2]["ts"]
    assert abs(complete[0]["ts"] / 1e6 - time.time()) < 60
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert [lanes[i] for i in range(len(LANES))] == list(LANES) and lanes[4] == "allreduce"
    assert {e["tid"] for e in complete if e["name"] == "forward"} == {LANES.index("compute")}
    assert {e["tid"] for e in complete if e["name"] == "send"} == {LANES.index("send")}
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert names == ["rank 1 (stage 0)"]
    assert [e["args"]["step"] for e in events if e["ph"] == "i"] == [3]


def test_span_records_when_body_raises():
    tracer = Tracer(0, stage=0, nvtx=False)
    with pytest.raises(RuntimeError, match="boom"):
        with tracer.span("backward", microbatch=0):
            raise RuntimeError("boom")
    assert [e["name"] for e in tracer.events] == ["backward"]


def test_disabled_tracer_records_nothing_and_is_cheap():
    tracer = Tracer(0, enabled=False)
    assert tracer.span("forward") is tracer.span("backward")  # one shared no-op context
    with tracer.span("forward", microbatch=0):
        pass
    tracer.add("send", "send", 0, 10)
    tracer.instant("x")
    assert tracer.events == []


def test_spans_show_in_torch_profiler():
    tracer = Tracer(0, stage=2, enabled=False, annotate=True, nvtx=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with tracer.span("forward", microbatch=3):
            torch.ones(8).mul(2)
    assert "forward stage2 mb3" in {e.key for e in prof.key_averages()}
    assert tracer.events == []


def test_plan_switch_context_and_event_cap():
    tracer = Tracer(0, stage=0, nvtx=False, max_events=2)
    with tracer.span("forward"):
        pass
    tracer.set_context(stage=1, plan_version=2)
    with tracer.span("forward"):
        pass
    with tracer.span("forward"):
        pass
    assert [(e["args"]["stage"], e["args"]["plan_version"]) for e in tracer.events] == [(0, 0), (1, 2)]
    assert tracer.dropped == 1
    assert tracer.process_name() == "rank 0 (stage 0->1)"
    tracer.set_context(stage=None)
    assert tracer.stage is None and tracer.plan_version == 2


def test_a_rank_holding_several_stages_is_named_by_all_of_them():
    # QA: a zbv rank holding stages 0 and 3 was named "rank 0 (stage 0)" in Perfetto, its log "[rank 0 stage 0,3]".
    tracer = Tracer(0, nvtx=False)
    recorder = MetricsRecorder(0, tracer=tracer)  # the engine sets both through the recorder
    recorder.set_context(0, 0, (0, 3))
    recorder.set_context(0, 0, (0, 3))
    assert tracer.process_name() == "rank 0 (stage 0,3)" and tracer.stage == 0
    recorder.set_context(0, 1, (0, 2))  # a switch to another V
    assert tracer.process_name() == "rank 0 (stage 0,3->0,2)"


def test_merge_traces(tmp_path):
    paths = [_spans(rank, stage=rank).save(tmp_path / f"rank{rank}.json") for rank in range(2)]
    out = merge_traces(paths, tmp_path / "all.json")
    merged = read_trace(out)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in merged if e["name"] == "process_name"}
    assert processes == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)"}
    timed = [e for e in merged if e["ph"] != "M"]
    assert len([e for e in timed if e["ph"] == "X"]) == 10
    assert min(e["ts"] for e in timed) == 0.0
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)
    # Relative timing across ranks is kept: rank 1's first span starts after rank 0's.
    first = {pid: min(e["ts"] for e in timed if e["pid"] == pid) for pid in (0, 1)}
    assert first[1] > first[0]
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="bad.json: not a Chrome trace"):
        merge_traces([tmp_path / "bad.json"], tmp_path / "x.json")


def test_command_line_merge(tmp_path, capsys):
    from model_parallel.cli.tracing import main

    for rank in range(2):
        _spans(rank, stage=rank).save(tmp_path / f"rank{rank}.json")
    assert main([str(tmp_path / "all.json"), str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {e["pid"] for e in read_trace(tmp_path / "all.json")["traceEvents"]} == {0, 1}
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "x.json"), str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("text, words", [
    ("[" * 5000 + "]" * 5000, r"t\.json: nested deeper than 64 levels"),
    ('{"traceEvents": [{"ts": ' + "9" * 5000 + "}]}", r"t\.json:1: an integer of 5000 digits"),
    ('{"traceEvents": [{"ts": "x", "pid": [], "name": 5, "ph": 7}]}', r"t\.json: traceEvents\[0\]\.ts must be a number"),
    ('{"traceEvents": [{"ts": 1, "pid": []}]}', r"t\.json: traceEvents\[0\]\.pid must be an integer"),
    ('{"traceEvents": [5]}', r"t\.json: traceEvents\[0\] must be an object"),
    ('{"traceEvents": [], "otherData": {"dropped_events": "x"}}', r"t\.json: otherData\.dropped_events"),
])
def test_a_hostile_trace_is_one_typed_error_naming_the_file(tmp_path, text, words):
    from model_parallel.errors import LogFormatError

    (tmp_path / "t.json").write_text(text)
    with pytest.raises(LogFormatError, match=words):
        merge_traces([tmp_path / "t.json"], tmp_path / "out.json")


def test_a_merged_trace_given_again_is_skipped_not_merged_twice(tmp_path):
    # QA: `model-parallel trace traces/all.json traces/` then `model-parallel trace other.json traces/` merged all.json
    # in too: every span twice, half of them rebased to 0 beside the raw clocks.
    paths = [_spans(rank, stage=rank).save(tmp_path / f"rank{rank}.json") for rank in range(2)]
    first = read_trace(merge_traces(paths, tmp_path / "all.json"))["traceEvents"]
    again = read_trace(merge_traces(sorted(tmp_path.glob("*.json")), tmp_path / "other.json"))["traceEvents"]
    assert sorted(json.dumps(e, sort_keys=True) for e in again) == sorted(json.dumps(e, sort_keys=True) for e in first)
    older = read_trace(tmp_path / "all.json")  # one written before merged traces were marked
    older["otherData"].pop("merged")
    (tmp_path / "all.json").write_text(json.dumps(older))
    assert len(read_trace(merge_traces(paths + [tmp_path / "all.json"], tmp_path / "third.json"))["traceEvents"]) == len(first)
