"""The image-classification profiler command line: files written, summary fields, clear errors."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from model_parallel.cli.common import run_cli
from model_parallel.graph import render
from model_parallel.graph.io import load_graph
from model_parallel.profiler import resume
from model_parallel.profiler.image_classification import feasibility
from model_parallel.profiler.image_classification import classifier
from model_parallel.profiler.image_classification import main as cli
from model_parallel.profiler.resume import PARTIAL_NAME
from model_parallel.profiler.timing import Replay

QUICK = ["-b", "2", "--image-size", "32", "--warmup", "0", "--iterations", "1", "--step-iterations", "1"]


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(cli.main, argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_missing_dot_warns_once_and_continues(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(render.shutil, "which", lambda name: None)
    code, _, err = run(["-a", "mobilenet_v3_small", *QUICK, "--num-classes", "10", "--profile_directory", str(tmp_path)], capsys)
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "graphviz 'dot' is not installed" in warnings[0]
    assert (tmp_path / "mobilenet_v3_small" / "profile_summary.json").exists()
    assert not (tmp_path / "mobilenet_v3_small" / "graph.svg").exists()


def test_unknown_arch_exits_2_listing_valid_ones(tmp_path: Path, capsys: pytest.CaptureFixture):
    code, _, err = run(["-a", "resnet19", "--profile_directory", str(tmp_path)], capsys)
    assert code == 2
    assert "unknown architecture 'resnet19'; valid ones: alexnet," in err and "resnet152" in err and "vgg16" in err
    assert len(err.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_too_small_images_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture):
    code, _, err = run(["-a", "inception_v3", "--image-size", "32", "--profile_directory", str(tmp_path)], capsys)
    assert code == 2 and "inception_v3 needs --image-size >= 75, got 32" in err
    code, _, err = run(["-a", "resnet18", "-b", "0"], capsys)
    assert code == 2 and "--batch-size must be >= 1, got 0" in err


def test_rounds_keep_each_nodes_median():
    from model_parallel.graph.core import Graph, Node

    def graph(times: list[float]) -> Graph:
        return Graph(nodes=tuple(Node(f"n{i}", "X", t, 2 * t) for i, t in enumerate(times)), edges=(("n0", "n1"),))

    merged = classifier._median_graph([graph([1.0, 5.0]), graph([3.0, 4.0]), graph([2.0, 9.0])])
    assert [(n.forward_ms, n.backward_ms) for n in merged.nodes] == [(2.0, 4.0), (5.0, 10.0)]
    assert merged.edges == (("n0", "n1"),)


# ---- progress, estimate, resume (issue 27) ---------------------------------------------------------
def test_progress_and_estimate_come_first(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(feasibility, "SLOW_SECONDS", 0.0)  # every run is "slow": the advice is printed
    code, _, err = run(["-a", "resnet18", *QUICK, "--image-size", "40", "--num-classes", "10",
                        "--profile_directory", str(tmp_path)], capsys)
    assert code == 0
    lines = err.replace("\r", "\n").splitlines()
    assert lines[0].startswith("profiling resnet18: batch 2 of 40x40 images (synthetic) on cpu, 1 thread(s); timing each node")
    assert re.match(r"peak memory about \d+ MB of [\d.]+ [GM]B available \(weights and gradients \d+ MB, activations kept", lines[1])
    assert re.match(r"estimate: a training step takes about [\d.]+ m?s at batch 2 \(timed at batch 2\); profiling costs about 5 steps", lines[2])
    assert lines[3].startswith("warning: profiling will take about") and "--image-size 32 (about" in lines[3] and "resumes" in lines[3]
    first_bar = next(i for i, line in enumerate(lines) if line.startswith("timing ResNet nodes:"))
    assert first_bar > 3 and any(line.startswith("timing training steps (2/2): 100%") for line in lines)
    assert any(re.match(r"timing ResNet nodes: 100%.* 70/70", line) for line in lines)
    summary = json.loads((tmp_path / "resnet18" / "profile_summary.json").read_text())
    assert summary["estimated_seconds"] > 0 and summary["estimated_peak_bytes"] > summary["parameter_bytes"]
    assert summary["resumed_nodes"] == 0 and not (tmp_path / "resnet18" / PARTIAL_NAME).exists()


def test_memory_that_cannot_fit_exits_2_before_profiling(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(feasibility, "available_memory_bytes", lambda device: 100_000_000)
    code, _, err = run(["-a", "resnet18", "-b", "64", "--image-size", "64", "--profile_directory", str(tmp_path)], capsys)
    assert code == 2 and "timing" not in err.split("error:")[0].split("\n", 1)[1]
    message = err.strip().splitlines()[-1]
    assert re.search(r"error: resnet18 at batch 64, 64x64 needs about [\d.]+ [GM]B to profile \(weights and gradients \d+ MB, "
                     r"activations kept for backward [\d.]+ [GM]B\) but 100 MB is available on cpu; even batch 1 does not fit: "
                     r"use a smaller --image-size, or --force to try anyway$", message)
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(feasibility, "available_memory_bytes", lambda device: 120_000_000)
    code, _, err = run(["-a", "resnet18", *QUICK, "-b", "64", "--num-classes", "10", "--profile_directory", str(tmp_path)], capsys)
    assert code == 2 and re.search(r"but 120 MB is available on cpu; use -b \d+ \(about \d+ MB\) or a smaller --image-size, or --force", err)
    code, _, err = run(["-a", "resnet18", *QUICK, "-b", "64", "--num-classes", "10", "--force", "--profile_directory", str(tmp_path)], capsys)
    assert code == 0 and "(going on: --force)" in err


def test_estimates_scale_and_advise():
    memory = feasibility.MemoryEstimate(batch_size=64, parameter_bytes=100, activation_bytes=6400, available_bytes=2000)
    assert memory.peak_bytes == 6600 and not memory.fits and memory.largest_batch() == 16  # (0.9 * 2000 - 2 * 100) // (6400 / 64)
    timing = feasibility.TimeEstimate(step_s=30.0, probe_batch=2, warmup=1, iterations=3, step_iterations=5, rounds=1)
    assert timing.total_s == pytest.approx(30.0 * (1 + 10 + 4 + 2 / 3))
    advice = timing.advice(64, 224, torch.device("cpu"), threads=1)
    assert advice[0] == "--image-size 32 (about 10 s)" and advice[1] == "-b 8 (about 59 s)"
    assert advice[2].startswith("--warmup 0 --iterations 1 --step-iterations 1 (about 2.3 min")
    assert any(a.startswith("--threads ") for a in advice) == ((os.cpu_count() or 1) > 1)


def test_interrupted_profile_resumes_from_the_timed_nodes(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch):
    argv = ["-a", "resnet18", *QUICK, "--num-classes", "10", "--profile_directory", str(tmp_path)]
    partial_path = tmp_path / "resnet18" / PARTIAL_NAME
    original_record = resume.RoundStore.record
    recorded: list[str] = []

    def stop_after_20(self, node_id, timing):  # a deterministic Ctrl-C: after exactly 20 timed nodes
        original_record(self, node_id, timing)
        recorded.append(node_id)
        if len(recorded) == 20:
            raise KeyboardInterrupt

    monkeypatch.setattr(resume.RoundStore, "record", stop_after_20)
    code, _, err = run(argv, capsys)
    assert code == 130 and f"measurements so far are kept in {partial_path}: run the same command again to resume" in err
    saved = json.loads(partial_path.read_text())
    assert len(saved["rounds"][0]["nodes"]) == 20 and saved["step_chunks"] == [[pytest.approx(saved["step_chunks"][0][0])]]
    assert not (tmp_path / "resnet18" / "graph.txt").exists()

    replays = []
    monkeypatch.setattr(resume.RoundStore, "record", lambda self, node_id, timing: (recorded.append(node_id), original_record(self, node_id, timing)))
    original_time = Replay.time
    monkeypatch.setattr(Replay, "time", lambda self, *a, **k: (replays.append(1), original_time(self, *a, **k))[1])
    code, _, err = run(argv, capsys)
    assert code == 0
    assert "resuming: 20 of 69 nodes already timed" in err and "reusing 1 training step time(s)" in err
    assert len(recorded) == 69 and len(set(recorded)) == 69  # the rerun timed only the other 49 nodes
    assert len(replays) == 49 + 1  # and replayed nothing else but the loss
    graph = load_graph(tmp_path / "resnet18" / "graph.txt")
    assert len(graph) == 70
    for node_id, (forward, backward) in saved["rounds"][0]["nodes"].items():
        assert (graph[node_id].forward_ms, graph[node_id].backward_ms) == pytest.approx((forward, backward), abs=1e-3)
    summary = json.loads((tmp_path / "resnet18" / "profile_summary.json").read_text())
    assert summary["resumed_nodes"] == 20 and not partial_path.exists()


def test_partial_profile_with_other_settings_starts_fresh(tmp_path: Path):
    path = tmp_path / PARTIAL_NAME
    first = resume.PartialProfile.open(path, {"batch_size": 8, "arch": "resnet18"})
    first.add_step(0, 12.5)
    said: list[str] = []
    same = resume.PartialProfile.open(path, {"batch_size": 8, "arch": "resnet18"}, said.append)
    assert same.steps(0) == [12.5] and said == []
    other = resume.PartialProfile.open(path, {"batch_size": 64, "arch": "resnet18"}, said.append)
    assert other.steps(0) == [] and said == [f"{path} was made with other settings (batch_size 8 -> 64); starting fresh"]
    path.write_text('{"schema": "model_parallel.partial_profile", "version": 1, "key": {"batch_size": 8, "arch": "resnet18"}, '
                    '"step_chunks": [["__import__(\'os\')"]], "rounds": []}')
    assert resume.PartialProfile.open(path, {"batch_size": 8, "arch": "resnet18"}, said.append).steps(0) == []
    assert said[-1] == f"{path}: malformed measurements; starting fresh"


# ---- the converter (step 3) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def partitioned_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 on resnet18 at 32 pixels: gpus=3.txt (+ its graph.json sidecar) in <tmp>/part."""
    from model_parallel.optimizer.optimizer_graph_hierarchical import main as optimize

    root = tmp_path_factory.mktemp("workflow")
    graph, summary = classifier.profile_arch("resnet18", 2, 32, device="cpu", warmup=0, iterations=1, num_classes=10, step_iterations=1)
    classifier.write_profile(graph, summary, root / "profiles" / "resnet18")
    assert optimize(["-f", str(root / "profiles" / "resnet18" / "graph.txt"), "-n", "3", "--straight_pipeline",
                     "--activation_compression_ratio", "1", "-o", str(root / "part")]) == 0
    return root / "part" / "gpus=3.txt"


def test_converter_refuses_another_arch(partitioned_profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    from model_parallel.optimizer.convert_graph_to_model import main as convert

    with pytest.raises(SystemExit) as exit_info:
        run_cli(convert, ["-f", str(partitioned_profile), "-n", "VGG16Partitioned", "-a", "vgg16",
                          "-o", str(tmp_path / "models"), "--stage_to_num_ranks", "0:1,1:1,2:1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"{partitioned_profile} was profiled from 'resnet18' but -a says 'vgg16'; use -a resnet18" in err
    assert not (tmp_path / "models").exists()


def test_converter_prices_a_plan_made_with_stage_to_num_ranks(partitioned_profile: Path, tmp_path: Path):
    from model_parallel.codegen.package import load_package
    from model_parallel.optimizer.convert_graph_to_model import main as convert

    out = tmp_path / "models" / "resnet18" / "gpus=3"
    assert convert(["-f", str(partitioned_profile), "-n", "ResNet18Partitioned", "-a", "resnet18", "-o", str(out),
                    "--stage_to_num_ranks", "0:1,1:1,2:1"]) == 0
    graph, plan = load_graph(partitioned_profile), load_package(out).plan
    assert plan.num_stages == 3 and [s.ranks for s in plan.stages] == [(0,), (1,), (2,)]
    for stage in plan.stages:
        expected_s = sum(graph[n].compute_ms for n in stage.node_ids) / 1000.0
        assert stage.compute_s > 0 and stage.compute_s == pytest.approx(expected_s)
    assert plan.single_machine_time_s == pytest.approx(graph.total_compute_ms / 1000.0)
    assert plan.time_per_minibatch_s >= max(s.compute_s for s in plan.stages) > 0
    assert "0.000 " not in plan.table().splitlines()[2]  # the worker log and `ctl status` print this table


def test_the_meta_memory_estimate_leaves_no_graph_behind():
    # The pack hook keeps a detached view: a saved output packed as itself would tie a C++ cycle no backward breaks.
    import gc
    import weakref

    from torch import nn

    class Keep(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.outputs = nn.Linear(4, 4), []

        def forward(self, x):
            out = torch.tanh(self.lin(x))  # tanh saves its output
            self.outputs.append(weakref.ref(out))
            return out

    with torch.device("meta"):
        model = Keep()
    _, activations = feasibility.meta_training_bytes(model, (torch.zeros(2, 4, device="meta"),), lambda out: out.sum())
    gc.collect()
    assert activations > 0 and model.outputs and all(ref() is None for ref in model.outputs)


def test_a_partial_profile_nested_too_deep_starts_fresh(tmp_path: Path):
    path = tmp_path / PARTIAL_NAME
    path.write_text("[" * 100_000 + "]" * 100_000)  # json.loads: a RecursionError
    said: list[str] = []
    assert resume.PartialProfile.open(path, {"batch_size": 8}, said.append).steps(0) == []
    assert said[-1].startswith(f"{path}: unreadable (") and said[-1].endswith("starting fresh")
