"""The profiler command line on real models and image folders, and as a plain script."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_parallel.cli.common import run_cli
from model_parallel.graph import render
from model_parallel.graph.io import load_graph
from model_parallel.profiler.image_classification import main as cli


SCRIPT = Path(cli.__file__)


QUICK = ["-b", "2", "--image-size", "32", "--warmup", "0", "--iterations", "1", "--step-iterations", "1"]


SUMMARY_KEYS = {"arch", "batch_size", "image_size", "device", "num_nodes", "torch_version", "measured_step_ms",
                "sum_layer_ms", "accuracy_ratio", "profiling_seconds", "overhead_ratio"}


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(cli.main, argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.slow
def test_profiles_resnet18_into_its_directory(tmp_path: Path, capsys: pytest.CaptureFixture):
    code, out, _ = run(["-a", "resnet18", *QUICK, "--num-classes", "10", "--profile_directory", str(tmp_path)], capsys)
    assert code == 0
    directory = tmp_path / "resnet18"
    assert {"graph.txt", "graph.json", "profile_summary.json"} <= {p.name for p in directory.iterdir()}
    assert f"wrote {directory / 'graph.txt'}" in out and "measured training step" in out
    summary = json.loads((directory / "profile_summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["arch"] == "resnet18" and summary["batch_size"] == 2 and summary["image_size"] == 32
    assert summary["device"] == "cpu" and summary["num_nodes"] == 70 and summary["torch_version"] == torch.__version__
    graph = load_graph(directory / "graph.txt")
    assert summary["sum_layer_ms"] == pytest.approx(graph.total_compute_ms)
    assert summary["accuracy_ratio"] == pytest.approx(summary["sum_layer_ms"] / summary["measured_step_ms"])
    assert summary["overhead_ratio"] == pytest.approx(summary["profiling_seconds"] * 1000 / summary["measured_step_ms"])
    assert graph["conv1"].layer is not None and graph.metadata["arch"] == "resnet18"  # the sidecar was picked up
    if render.dot_available():
        assert (directory / "graph.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.slow
def test_image_folder_data(tmp_path: Path, capsys: pytest.CaptureFixture):
    from PIL import Image

    for label in ("cats", "dogs"):
        (tmp_path / "data" / label).mkdir(parents=True)
        for index in range(2):
            Image.new("RGB", (40, 36), color=(index * 90, 30, 200)).save(tmp_path / "data" / label / f"{index}.png")
    code, _, _ = run(["-a", "resnet18", *QUICK, "--data_dir", str(tmp_path / "data"), "--profile_directory", str(tmp_path / "out")], capsys)
    assert code == 0
    summary = json.loads((tmp_path / "out" / "resnet18" / "profile_summary.json").read_text())
    assert summary["num_classes"] == 2 and summary["data"] == str(tmp_path / "data")
    assert load_graph(tmp_path / "out" / "resnet18" / "graph.json")["fc"].layer.outputs[0].shape == (2, 2)
    code, _, err = run(["-a", "resnet18", "-b", "8", "--data_dir", str(tmp_path / "data")], capsys)
    assert code == 2 and "holds 4 images, fewer than --batch-size 8" in err
    code, _, err = run(["-a", "resnet18", "--data_dir", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "not a readable ImageFolder" in err


@pytest.mark.slow
def test_runs_as_a_plain_script(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in ("-a ARCH, --arch ARCH", "--batch-size", "--image-size", "--profile_directory", "--data_dir", "--warmup", "--iterations"):
        assert flag in result.stdout
