"""Per-step metrics: the time split adds up, JSONL lines parse, killed writers leave whole lines, summaries."""
from __future__ import annotations

import json
import math
import time

import pytest

from model_parallel.messages import StepReport
from model_parallel.runtime.observe.metrics import MetricsRecorder
from model_parallel.runtime.observe.metrics_read import format_summary, read_events, read_metrics, summarize, throughput
from model_parallel.runtime.observe.tracing import Tracer


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_step_record_adds_up_and_is_written(tmp_path):
    tracer = Tracer(0, stage=0, nvtx=False)
    path = tmp_path / "metrics" / "rank{rank}.jsonl"
    with MetricsRecorder(0, path, stage=0, plan_version=3, tracer=tracer) as recorder:
        for step in range(2):
            recorder.begin_step(step)
            for microbatch in range(2):
                with recorder.measure("forward", microbatch=microbatch):
                    _busy(0.002)
                with recorder.measure("send", microbatch=microbatch):
                    _busy(0.001)
            with recorder.measure("backward", microbatch=0):
                _busy(0.002)
            _busy(0.002)  # time blocked in a recv / migration that the caller measured itself
            recorder.add("recv", 0.0015)
            recorder.add("migration", 0.0005)
            _busy(0.001)  # unaccounted: idle
            recorder.end_step(samples=32, loss=1.5)
    records = read_metrics(tmp_path / "metrics" / "rank0.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    r = records[1]
    assert (r["rank"], r["stage"], r["plan_version"], r["samples"], r["microbatches"], r["loss"]) == (0, 0, 3, 32, 2, 1.5)
    assert r["idle_ms"] == pytest.approx(r["step_ms"] - r["compute_ms"] - r["comm_ms"])
    assert r["compute_ms"] == pytest.approx(r["forward_ms"] + r["backward_ms"] + r["recompute_ms"] + r["optimizer_ms"])
    assert r["comm_ms"] == pytest.approx(r["send_ms"] + r["recv_ms"] + r["allreduce_ms"] + r["control_ms"] + r["migration_ms"])
    assert r["forward_ms"] >= 4.0 and r["send_ms"] >= 2.0 and r["backward_ms"] >= 2.0
    assert r["recv_ms"] == pytest.approx(1.5) and r["migration_ms"] == pytest.approx(0.5)
    assert r["idle_ms"] >= 0.9
    assert r["samples_per_s"] == pytest.approx(32 / (r["step_ms"] / 1000))
    # The tracer got one span per measured action, on the kind's lane.
    names = [(e["name"], e["cat"]) for e in tracer.events]
    assert names[:2] == [("forward", "compute"), ("send", "send")] and len(names) == 10
    report = recorder.records[1].to_report()  # the control channel's report: the same milliseconds, one shape
    assert report.step_ms == pytest.approx(r["step_ms"]) and report.idle_ms == pytest.approx(r["idle_ms"])
    assert (report.rank, report.stage, report.plan_version, report.loss) == (0, 0, 3, 1.5)
    assert StepReport.from_dict(report.to_dict()) == report


def test_pause_before_the_switch_step_counts_in_its_time_so_idle_is_never_negative():
    """A plan switch pauses between two steps; the next step carries the pause as migration time."""
    recorder = MetricsRecorder(rank=0)
    recorder.begin_step(3)
    recorder.add_before_step("migration", 0.2)  # paused 200 ms before begin_step
    with recorder.measure("forward"):
        time.sleep(0.01)
    record = recorder.end_step(samples=8)
    assert record.migration_ms == pytest.approx(200.0)
    assert record.step_ms >= record.compute_ms + record.comm_ms and record.idle_ms >= 0, record
    assert record.step_ms == pytest.approx(210.0, abs=50.0)


def test_recorder_errors():
    recorder = MetricsRecorder(1)
    with pytest.raises(ValueError, match="rank 1: end_step\\(\\) without begin_step\\(\\)"):
        recorder.end_step(samples=1)
    with pytest.raises(ValueError, match="unknown metrics kind 'fwd'"):
        recorder.measure("fwd")


def test_reader_skips_cut_off_last_line_and_rejects_garbage(tmp_path):
    recorder = MetricsRecorder(0, tmp_path / "m.jsonl", stage=0)
    recorder.begin_step(0)
    recorder.end_step(samples=8)
    recorder.close()
    with open(tmp_path / "m.jsonl", "a") as f:
        f.write('{"step": 1, "rank": 0, "step_')  # a process killed mid-line
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [0]
    (tmp_path / "bad.jsonl").write_text('{"step": 0, "rank": 0}\nnot json\n{"step": 1, "rank": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        read_metrics(tmp_path / "bad.jsonl")


def test_event_lines_are_read_apart_from_the_step_records(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 0, "rank": 0}\n{"event": "recovery", "generation": 1}\n'
                                      '{"step": 1, "rank": 0}\n')
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [0, 1]
    assert read_events(tmp_path / "m.jsonl", "recovery") == [{"event": "recovery", "generation": 1}]
    assert read_events(tmp_path / "m.jsonl", "join") == []


def _record(step, rank, stage, step_ms, compute_ms, comm_ms, samples=64):
    return {"step": step, "rank": rank, "stage": stage, "plan_version": 0, "samples": samples, "step_ms": step_ms,
            "compute_ms": compute_ms, "comm_ms": comm_ms, "idle_ms": step_ms - compute_ms - comm_ms}


def test_summarize_and_throughput(tmp_path):
    records = [
        _record(0, 0, 0, 500.0, 100.0, 10.0),  # warm-up step
        _record(0, 1, 1, 500.0, 100.0, 10.0),
        _record(1, 0, 0, 100.0, 40.0, 20.0),
        _record(1, 1, 1, 80.0, 70.0, 5.0),
        _record(1, 2, 1, 90.0, 50.0, 5.0),  # a replica of stage 1
        _record(1, 3, None, 1.0, 0.0, 0.0),  # a spare
        _record(2, 0, 0, 200.0, 40.0, 20.0),
        _record(2, 1, 1, 200.0, 70.0, 5.0),
    ]
    rows = summarize(records)
    assert [r["step"] for r in rows] == [0, 1, 2]
    row = rows[1]
    assert row["ranks"] == 4 and row["step_ms"] == 100.0 and row["samples_per_s"] == pytest.approx(640.0)
    assert row["stages"][1] == {"compute_ms": 60.0, "comm_ms": 5.0, "idle_ms": 20.0}
    assert row["bottleneck_stage"] == 1
    assert throughput(records, warmup=1) == pytest.approx(128 / 0.3)
    table = format_summary(rows)
    assert "s1:60.0/5.0/20.0" in table and len(table.splitlines()) == 4
    # Several per-rank files in a directory are read together.
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["rank"] == rank))
    assert len(read_metrics(tmp_path)) == 6


def test_a_step_recorded_again_by_a_resume_counts_once_with_the_later_record():
    # A run killed at step 7 after its checkpoint of step 5: steps 6 and 7 are in the files twice (appended).
    killed = [_record(step, rank, rank, 100.0, 50.0, 10.0) for step in range(8) for rank in (0, 1)]
    resumed = [_record(step, rank, rank, 300.0, 90.0, 10.0) for step in range(6, 10) for rank in (0, 1)]
    rows = summarize(killed + resumed)
    assert [r["step"] for r in rows] == list(range(10))
    assert all(r["ranks"] == 2 for r in rows)  # was 4 at steps 6 and 7: the two runs' records as replicas
    assert rows[6]["step_ms"] == 300.0 and rows[6]["stages"][0]["compute_ms"] == 90.0
    assert rows[5]["step_ms"] == 100.0


def test_command_line_summary(tmp_path, capsys):
    from model_parallel.cli.metrics import main

    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(_record(s, 0, 0, 100.0, 60.0, 10.0)) + "\n" for s in range(3)))
    assert main([str(tmp_path), "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "s0:60.0/10.0/30.0" in out and "throughput after 1 warm-up step(s): 640.0 samples/s" in out
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing.jsonl")])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("line, words", [
    # "... levels" or "... levels at [0][0]...": whether json's own recursion gave up first depends on the interpreter's
    # recursion limit, which another test may have raised (the full suite did).
    ("[" * 5000 + "]" * 5000, r"m\.jsonl:2: not a JSON object \(nested deeper than 64 levels"),
    ('{"step": ' + "9" * 5000 + ', "rank": 0}', r"m\.jsonl:2: not a JSON object \(an integer of 5000 digits"),
    ('{"step": "x", "rank": 0}', r"m\.jsonl:2: 'step' must be an integer, found \"x\""),
    ('{"step": 1, "rank": [1]}', r"m\.jsonl:2: 'rank' must be an integer, found \[1\]"),
    ('{"step": 1, "rank": 0, "stage": 0.5}', r"m\.jsonl:2: 'stage' must be an integer"),
    ('{"step": 1, "rank": 0, "step_ms": {}}', r"m\.jsonl:2: 'step_ms' must be a number, found \{\}"),
])
def test_a_hostile_line_is_one_typed_error_naming_file_and_line(tmp_path, line, words):
    from model_parallel.errors import LogFormatError

    (tmp_path / "m.jsonl").write_text('{"step": 0, "rank": 0}\n' + line + "\n")
    with pytest.raises(LogFormatError, match=words):
        read_metrics(tmp_path / "m.jsonl")


def test_a_nan_a_recorder_wrote_still_reads_and_a_record_without_times_is_named(tmp_path):
    from model_parallel.errors import LogFormatError

    (tmp_path / "m.jsonl").write_text('{"step": 0, "rank": 0, "step_ms": NaN, "loss": NaN}\n'
                                      '{"step": 1, "rank": 0}\n')
    records = read_metrics(tmp_path / "m.jsonl")
    assert math.isnan(records[0]["loss"])
    with pytest.raises(LogFormatError, match=r"the record of step 1, rank 0 has no \['step_ms'\]"):
        summarize(records)


def test_bad_utf8_names_file_and_line(tmp_path):
    from model_parallel.errors import LogFormatError

    (tmp_path / "m.jsonl").write_bytes(b'{"step": 0, "rank": 0}\n\xff\n')
    with pytest.raises(LogFormatError, match=r"m\.jsonl:2: not a text file"):
        read_metrics(tmp_path / "m.jsonl")


def test_a_rank_holding_several_stages_is_labelled_by_all_of_them(tmp_path):
    # QA: under zbv rank 0 runs stages 0 and 3, rank 1 stages 1 and 2; every record said "stage": 0 / 1 and
    # `model-parallel metrics` printed "s0:... s1:..." as if each rank ran one stage.
    path = tmp_path / "rank{rank}.jsonl"
    for rank, stages in ((0, (0, 3)), (1, (1, 2))):
        with MetricsRecorder(rank, path) as recorder:
            recorder.set_context(stages[0], 0, stages)
            recorder.begin_step(0)
            recorder.end_step(samples=8)
    records = read_metrics(tmp_path)
    assert sorted((r["stage"], r["stages"]) for r in records) == [(0, [0, 3]), (1, [1, 2])]
    row = summarize(records)[0]
    assert row["labels"] == {0: "0,3", 1: "1,2"}
    assert " s0,3:" in format_summary([row]) and " s1,2:" in format_summary([row])
    with MetricsRecorder(2, path) as one:  # one stage: no `stages` field, the label is the stage
        one.set_context(2, 0, (2,))
        one.begin_step(0)
        assert "stages" not in one.end_step(samples=8).to_dict()


def test_a_stages_field_that_is_not_stage_numbers_is_named(tmp_path):
    from model_parallel.errors import LogFormatError

    (tmp_path / "m.jsonl").write_text('{"step": 0, "rank": 0, "stage": 0, "stages": "0,3"}\n')
    with pytest.raises(LogFormatError, match=r"m\.jsonl:1: 'stages' must be a list of stage numbers"):
        read_metrics(tmp_path / "m.jsonl")
