"""Measured stashed activations (runtime/observe/memory_probe.StashMeter) against the footprint model
(optimizer/memory.py, from the profiler's `Node.saved_bytes`): 2-stage MLP and TinyGPT runs under 1F1B
and GPipe, and the tables that show both."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from model_parallel.runtime.observe.memory_table import Measured, format_memory
from model_parallel.graph.io import load_graph, save_graph
from model_parallel.graph.saved import covered, span
from model_parallel.profiler.api import profile
from model_parallel.profiler.saved import record_saved_bytes
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.observe.memory_probe import StashMeter


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
