"""Measured stashed activations (runtime/memory_probe.StashMeter) against the footprint model
(optimizer/memory.py): a 2-stage MLP under 1F1B and GPipe, and the tables that show both."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from model_parallel.cli.memory_summary import Measured, format_memory
from model_parallel.cli.report import stage_memory
from model_parallel.graph.io import load_graph
from model_parallel.graph.plan import read_plan
from model_parallel.optimizer.memory import Footprint, in_flight
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.memory_probe import StashMeter
from model_parallel.runtime.metrics import read_metrics
from support.mlp import mlp_job

BATCH, MICRO = 16, 4


def test_the_meter_counts_saved_tensors_until_release_and_skips_parameters_and_data() -> None:
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = torch.randn(8, 8)
    meter = StashMeter(torch.device("cpu"))
    parts = torch.tensor_split(data, 2)
    with meter.step(stage, parts):
        losses = []
        for j, x in enumerate(parts):
            meter.begin(j)
            loss = stage(x).sum()
            meter.kept(j, SimpleNamespace(inputs=[x], outputs=[loss], weights=None))
            losses.append(loss)
        # Per microbatch: ReLU's output (saved by it and the second Linear: one storage), the first Linear's
        # output is not saved (ReLU saves its result), the data slice and the weights are not counted; the
        # 0-d loss kept by the executor is.
        one = 4 * 16 * 4 + 4
        assert meter.total == meter.step_peak == 2 * one
        losses[0].backward()
        meter.release(0)
        assert meter.total == one
        losses[1].backward()
        meter.release(1)
    assert meter.total == 0 and meter.peak == 2 * one


def _run(tmp_path: Path) -> tuple[dict[str, list[dict]], str]:
    _, plan = mlp_job(tmp_path, 2, BATCH, MICRO)
    jobs = [["--model", "mlp", "--plan", str(plan), "--steps", "3", "--batch_size", str(BATCH),
             "--num_microbatches", str(MICRO), "--schedule", schedule, "--measure_memory", "--timeout", "30",
             "--metrics", str(tmp_path / f"{schedule}-rank{{rank}}.jsonl")] for schedule in ("1f1b", "gpipe")]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    result = launch_workers(["--jobs", str(tmp_path / "jobs.json")], 2, timeout=150)
    assert result.ok, result.summary()
    records = {s: read_metrics(sorted(tmp_path.glob(f"{s}-rank*.jsonl"))) for s in ("1f1b", "gpipe")}
    return records, result.output(0)


@pytest.mark.timeout(200)
def test_measured_stash_follows_the_schedule_and_the_tables_show_both(tmp_path: Path) -> None:
    records, out = _run(tmp_path)
    graph, plan = load_graph(tmp_path / "graph.json"), read_plan(tmp_path / "plan.json").with_default_ranks()
    peaks = {s: {k: max(r["stash_peak_bytes"] for r in rs if r["stage"] == k) for k in (0, 1)} for s, rs in records.items()}
    flights = {s: [in_flight(Footprint("sgd_momentum", s, MICRO), 2, k, 1) for k in (0, 1)] for s in records}
    assert flights == {"1f1b": [2, 1], "gpipe": [4, 4]}
    for k in (0, 1):
        # The peak is exactly the predicted number of microbatches in flight times one microbatch's bytes:
        # GPipe's stage 0 holds all m = 4, 1F1B's min(m, p - k).
        one = peaks["1f1b"][k] / flights["1f1b"][k]
        assert one > 0 and peaks["gpipe"][k] == flights["gpipe"][k] * one
    assert peaks["gpipe"][0] == 2 * peaks["1f1b"][0] and peaks["gpipe"][1] == 4 * peaks["1f1b"][1]

    for schedule, rs in records.items():
        parts, rows = stage_memory(graph, plan, rs, optimizer="sgd", momentum=0.9, schedule=schedule,
                                   microbatches=MICRO, microbatch_size=BATCH // MICRO)
        for p, m in zip(parts, rows):
            # Parameters + gradients + SGD momentum are predicted exactly (counted after the backwards).
            assert m.held == p["parameters"] + p["gradients"] + p["optimizer_state"] and m.weights_opt > 0
            # The profile counts every node's output; autograd keeps what backward reads (for Linear+ReLU
            # about half, plus the received inputs on stage 1): the prediction is high by at most 2.5x.
            assert 1.0 <= p["activations"] / m.stash_peak <= 2.5, (schedule, p, m)
            assert m.peak == m.held + m.stash_peak and abs(p["total"] - m.peak) / m.peak < 0.1
        text = format_memory(parts, [(str(m.stage), m) for m in rows], "stage", "cuda_max_allocated")
        header, _, first, second, _ = text.splitlines()
        assert "predicted MB" in header and "measured MB" in header and "error" in header
        for line, p, m in ((first, parts[0], rows[0]), (second, parts[1], rows[1])):
            fields = line.split()
            assert float(fields[2]) == pytest.approx(p["total"] / 1e6, abs=1e-3)
            assert float(fields[3]) == pytest.approx(m.peak / 1e6, abs=1e-3) and fields[4].endswith("%")
    # The worker's end-of-run table is the same formatter, per rank, with the measured columns filled in.
    tables = [block.split("\n")[:4] for block in out.split("memory per stage, predicted vs measured:\n")[1:]]
    assert len(tables) == 2
    for table in tables:
        for line in table[2:]:
            fields = line.split()
            assert fields[0] == fields[1] and "n/a" not in fields[:8] and float(fields[3]) > 0, table


def test_a_run_without_the_meter_shows_measured_as_not_available() -> None:
    parts = [{"total": 3e6, "parameters": 1e6, "gradients": 1e6, "optimizer_state": 1e6, "weight_stash": 0.0,
              "activations": 0.0}]
    text = format_memory(parts, [("0", Measured(0, 2e6, None, None, 5e6)), ("1", Measured(None))], "rank", "peak_rss_growth")
    row, spare = text.splitlines()[2:4]
    assert row.split()[:5] == ["0", "0", "3.000", "n/a", "n/a"] and spare.split() == ["1", "spare"]
