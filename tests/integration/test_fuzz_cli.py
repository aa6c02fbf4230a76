"""The real entry points as processes: bad input prints one line and exits 2."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from support import REPO
from support.images import corrupt_image_folder


CONVERT = "model_parallel.optimizer.convert_graph_to_model"


OPTIMIZE = "model_parallel.optimizer.optimizer_graph_hierarchical"


def _tool(module: str) -> Callable:
    return importlib.import_module(module).main


@pytest.mark.slow
def test_real_entry_points_print_one_line(tmp_path: Path) -> None:
    """The scripts as users run them: exit 2, one line, no traceback."""
    bad = tmp_path / "bad.txt"
    bad.write_text("node1 -- Conv2d -- forward_compute_time=abc\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commands = []
    if _tool(CONVERT) is not None:
        commands.append([sys.executable, str(REPO / "model_parallel/optimizer/convert_graph_to_model.py"),
                         "-f", str(bad), "-n", "M", "-a", "m", "-o", str(tmp_path / "pkg")])
    if _tool(OPTIMIZE) is not None:
        commands.append([sys.executable, str(REPO / "model_parallel/optimizer/optimizer_graph_hierarchical.py"),
                         "-f", str(bad), "-n", "2", "-o", str(tmp_path / "opt")])
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and "bad.txt:1" in result.stderr, result.stderr
        assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr
    assert not (tmp_path / "pkg").exists() and not (tmp_path / "opt").exists()


@pytest.mark.slow
def test_real_worker_entry_point_on_bad_inputs(tmp_path: Path) -> None:
    """The worker script as users run it: a missing control script and a corrupt image, exit 2, one line."""
    broken = corrupt_image_folder(tmp_path / "images")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = [sys.executable, str(REPO / "test_parallel_0.py"), "--single_process", "--steps", "1"]
    commands = {
        "absent.json: no such file": [*worker, "--model", "mlp", "--control_script", str(tmp_path / "absent.json")],
        f"{broken}: cannot decode this image": [*worker, "--model", "resnet18", "--data", str(tmp_path / "images"),
                                                 "--batch_size", "3", "--num_microbatches", "1"],
    }
    procs = {expected: subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for expected, command in commands.items()}
    try:
        for expected, proc in procs.items():
            _, err = proc.communicate(timeout=180)
            errors = [line for line in err.splitlines() if "error:" in line]
            assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
            assert len(errors) == 1 and expected in errors[0], err[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
