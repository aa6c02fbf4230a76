"""The main job end to end (small), and the report's pure pieces."""
import json
import sys

import pytest

from model_parallel.cli import demo
from model_parallel.cli.report import throughput_phases


def rows(*spec):
    return [{"step": step, "plan_version": version, "samples_per_s": value} for step, version, value in spec]


def test_throughput_phases_split_at_the_slowdown_and_the_first_switch():
    data = rows((0, 0, 1), (1, 0, 1), (2, 0, 100), (3, 0, 100), (4, 0, 50), (5, 0, 50), (6, 0, 50), (7, 1, 10),
                (8, 1, 10), (9, 1, 90), (10, 1, 90))
    phases = throughput_phases(data, slow_at=4, settle=2)
    assert phases == {"before": 100, "slowed": 50, "after": 90, "switch_step": 7, "steps_to_detect": 3,
                      "earlier_switches": []}


def test_throughput_phases_without_a_switch():
    phases = throughput_phases(rows((0, 0, 5), (1, 0, 5), (2, 0, 5)), slow_at=1, settle=0)
    assert phases["after"] is None and phases["switch_step"] is None and phases["slowed"] == 5


@pytest.mark.slow
def test_worker_and_coordinator_lines_show_once_and_as_they_come(capsys):
    """Worker lines name their rank already (no `[rank 2] [rank 2 stage 2]`); coordinator decisions stream live."""
    class Bar:
        def __init__(self):
            self.written = []

        def write(self, text):
            self.written.append(text)

    bar = Bar()
    echo = demo._Echo(bar)
    echo(2, "12:00:01 WARNING model_parallel.runtime.engine: [rank 2 stage 2] switch to plan v1 at step 5")
    echo(1, "test_parallel_0.py: error: something failed")
    assert bar.written == ["  12:00:01 WARNING model_parallel.runtime.engine: [rank 2 stage 2] switch to plan v1 at step 5",
                           "  [rank 1] test_parallel_0.py: error: something failed"]
    coordinator = demo._CoordinatorEcho()
    coordinator(0, "12:00:00 [coordinator] INFO x: coordinator listening on 127.0.0.1:1 (policy auto, plan v0, 3 stage(s))")
    assert "[coordinator] coordinator listening" in capsys.readouterr().out  # before the bar exists: printed
    coordinator.bar = bar
    coordinator(0, "12:00:02 [coordinator] INFO x: switching to plan v1: predicted 5.00 -> 4.00 ms")
    assert bar.written[-1] == "  [coordinator] switching to plan v1: predicted 5.00 -> 4.00 ms"


@pytest.mark.slow
def test_demo_runs_the_whole_workflow(tmp_path, capsys):
    out = tmp_path / "run"
    code = demo.main(["--out", str(out), "--steps", "16", "--slow-at", "4", "--workers", "2", "--batch-size", "16"])
    assert code == 0
    text = capsys.readouterr().out
    assert "== plan (initial) ==" in text and "== throughput" in text
    for artifact in ("profiles/resnet18/graph.txt", "profiles/resnet18/graph.json", "partition/gpus=2.txt",
                     "partition/plan.json", "package/stage0.py", "package/stage1.py", "package/hybrid_conf.json",
                     "metrics/rank0.jsonl", "metrics/rank1.jsonl", "throughput.png", "report.json",
                     "pipeline_trace.json", "logs/coordinator.log"):
        assert (out / artifact).is_file(), artifact
    report = json.loads((out / "report.json").read_text())
    assert report["workers"] == 2 and report["throughput_before"] > 0
    assert len(report["predicted_stage_ms"]) == 2
    # Predicted vs measured busy time per stage, priced with the run's calibration (issue 26).
    assert (out / "profiles" / "calibration.json").is_file() and "error" in text
    assert all(isinstance(ms, float) and ms > 0 for ms in report["measured_stage_ms"])
    # Predicted vs measured (tensor-accounted, --measure_memory) peak memory per stage (issue 25).
    assert "== per-stage peak memory" in text and len(report["predicted_stage_memory_bytes"]) == 2
    assert all(isinstance(b, float) and b > 0 for b in report["measured_stage_memory_bytes"])
    assert all(b > 0 for b in report["measured_stage_activation_bytes"])
    trace = json.loads((out / "pipeline_trace.json").read_text())
    assert any(e.get("name", "").startswith("forward") for e in trace["traceEvents"])
    # Each plan switch the report lists is a span in the trace (the pause was a bare gap before, issue 37).
    migrations = {e["args"]["plan_version"] for e in trace["traceEvents"] if e.get("name", "").startswith("migration to plan v")}
    assert {s["version"] for s in report.get("switches", [])} <= migrations
    assert list((out / "checkpoint").glob("step_*"))


@pytest.mark.slow
def test_demo_failure_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["demo"])
    with pytest.raises(SystemExit) as exit_info:
        from model_parallel.cli.common import run_cli

        run_cli(demo.main, ["--out", str(tmp_path / "x"), "--arch", "no_such_model"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "profile failed" in err and "no_such_model" in err
