"""Measured stashed activations (runtime/memory_probe.StashMeter) against the footprint model
(optimizer/memory.py, from the profiler's `Node.saved_bytes`): 2-stage MLP and TinyGPT runs under 1F1B
and GPipe, and the tables that show both."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from model_parallel.cli.memory_summary import Measured, format_memory
from model_parallel.cli.report import stage_memory
from model_parallel.graph.io import load_graph, save_graph
from model_parallel.graph.plan import read_plan, write_plan
from model_parallel.graph.saved import covered, span
from model_parallel.optimizer.memory import Footprint, in_flight
from model_parallel.profiler.api import profile
from model_parallel.profiler.saved import record_saved_bytes
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.memory_probe import StashMeter
from model_parallel.runtime.metrics import read_metrics
from model_parallel.runtime.stages import even_plan
from model_parallel.runtime.zoo import recipe

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


def _direct_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """What autograd saves in `model(x)`, counted straight from a pack hook (each storage's byte ranges
    once), the parameters' storages aside (the second Linear saves its weight's transpose, a view):
    the oracle for the profiler's attribution."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in weights:
            pointer, start, end = span(tensor)
            ranges.setdefault(pointer, []).append((start, end))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(covered(r) for r in ranges.values())


def test_saved_bytes_of_linear_relu_are_what_autograd_saves_each_storage_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU())
    graph, gm = trace_model(model, (torch.randn(5, 8),))
    x = torch.randn(5, 8)
    saved = record_saved_bytes(gm, (x,))
    # The oracle: the same forward under a plain pack hook, minus the input the first Linear saves (the
    # step's data: the profiler leaves it out, as the runtime's meter does).
    direct = _direct_saved_bytes(model, x) - x.numel() * x.element_size()
    assert sum(saved.nodes.values()) == direct > 0 and saved.loss == 0
    # Per node: ReLU's result is saved (by it and by the next Linear's weight gradient: one storage,
    # charged to the ReLU), a Linear's output is not (ReLU saves its result), the data is not charged.
    names = [n.node_id for n in graph.nodes]
    assert [saved.nodes[n] for n in names] == [0, 0, 5 * 16 * 4, 0, 5 * 4 * 4]


def _profiled_job(tmp_path: Path, name: str) -> Path:
    """graph.json of `--model name` profiled at the microbatch size (what autograd saves per node), and an
    even 2-stage plan; returns the plan's path."""
    r = recipe(name)
    inputs, target = r.data(BATCH // MICRO, 0).batch(0)
    graph = profile(r.model(0), inputs, lambda out: r.criterion(out, target), timing="insitu", warmup=0, iterations=1)
    assert all(n.saved_bytes is not None for n in graph.nodes)
    save_graph(graph, tmp_path / f"{name}.json")
    write_plan(even_plan(graph, 2), tmp_path / f"{name}-plan.json")
    return tmp_path / f"{name}-plan.json"


def _run(tmp_path: Path) -> tuple[dict[tuple[str, str], list[dict]], str]:
    jobs = [["--model", name, "--plan", str(_profiled_job(tmp_path, name)), "--steps", "3", "--batch_size", str(BATCH),
             "--num_microbatches", str(MICRO), "--schedule", schedule, "--measure_memory", "--timeout", "30",
             "--metrics", str(tmp_path / f"{name}-{schedule}-rank{{rank}}.jsonl")]
            for name in ("mlp", "gpt") for schedule in ("1f1b", "gpipe")]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    result = launch_workers(["--jobs", str(tmp_path / "jobs.json")], 2, timeout=250)
    assert result.ok, result.summary()
    records = {(n, s): read_metrics(sorted(tmp_path.glob(f"{n}-{s}-rank*.jsonl")))
               for n in ("mlp", "gpt") for s in ("1f1b", "gpipe")}
    return records, result.output(0)


@pytest.mark.timeout(350)
def test_measured_stash_follows_the_schedule_and_the_tables_show_both(tmp_path: Path) -> None:
    records, out = _run(tmp_path)
    peaks = {key: {k: max(r["stash_peak_bytes"] for r in rs if r["stage"] == k) for k in (0, 1)}
             for key, rs in records.items()}
    flights = {s: [in_flight(Footprint("sgd_momentum", s, MICRO), 2, k, 1) for k in (0, 1)] for s in ("1f1b", "gpipe")}
    assert flights == {"1f1b": [2, 1], "gpipe": [4, 4]}
    for name in ("mlp", "gpt"):
        for k in (0, 1):
            # The peak is exactly the predicted number of microbatches in flight times one microbatch's bytes:
            # GPipe's stage 0 holds all m = 4, 1F1B's min(m, p - k).
            one = peaks[name, "1f1b"][k] / flights["1f1b"][k]
            assert one > 0 and peaks[name, "gpipe"][k] == flights["gpipe"][k] * one

    for (name, schedule), rs in records.items():
        graph = load_graph(tmp_path / f"{name}.json")
        plan = read_plan(tmp_path / f"{name}-plan.json").with_default_ranks()
        parts, rows = stage_memory(graph, plan, rs, optimizer="sgd", momentum=0.9, schedule=schedule,
                                   microbatches=MICRO, microbatch_size=BATCH // MICRO)
        for p, m in zip(parts, rows):
            # Parameters + gradients + SGD momentum are predicted exactly (counted after the backwards).
            assert m.held == p["parameters"] + p["gradients"] + p["optimizer_state"] and m.weights_opt > 0
            # What autograd saves per node (profiled) plus the boundary tensors the executor keeps, times the
            # microbatches in flight: within 15 % of what the StashMeter measured, on every stage.
            assert abs(p["activations"] / m.stash_peak - 1) <= 0.15, (name, schedule, p, m)
            # The total inherits the activations' bound (the even plan follows the noisy profile, and some
            # cuts leave the activations 14 % off).
            assert m.peak == m.held + m.stash_peak and abs(p["total"] - m.peak) / m.peak <= 0.15
        if name == "gpt":
            continue
        text = format_memory(parts, [(str(m.stage), m) for m in rows], "stage", "cuda_max_allocated")
        header, _, first, second, _ = text.splitlines()
        assert "predicted MB" in header and "measured MB" in header and "error" in header
        for line, p, m in ((first, parts[0], rows[0]), (second, parts[1], rows[1])):
            fields = line.split()
            assert float(fields[2]) == pytest.approx(p["total"] / 1e6, abs=1e-3)
            assert float(fields[3]) == pytest.approx(m.peak / 1e6, abs=1e-3) and fields[4].endswith("%")
    # The worker's end-of-run table is the same formatter, per rank, with the measured columns filled in.
    tables = [block.split("\n")[:4] for block in out.split("memory per stage, predicted vs measured:\n")[1:]]
    assert len(tables) == len(records)
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


def test_saved_bytes_round_trip_through_graph_json_and_the_graph_txt_sidecar(tmp_path: Path) -> None:
    graph, _ = trace_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    graph = replace(graph, nodes=tuple(replace(n, saved_bytes=32.0) if n.node_id == "_1" else n for n in graph.nodes))
    for name in ("graph.json", "graph.txt"):
        save_graph(graph, tmp_path / name)
        back = load_graph(tmp_path / name)
        # Profiled: kept; not profiled (None): the footprint falls back to the node's output bytes.
        assert [n.saved_bytes for n in back.nodes] == [None, None, 32.0]
        assert back["_0"].stash_bytes == back["_0"].activation_bytes and back["_1"].stash_bytes == 32.0
    data = json.loads((tmp_path / "graph.json").read_text())
    assert [e["id"] for e in data["nodes"] if "saved_bytes" in e] == ["_1"]
