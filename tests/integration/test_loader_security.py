"""Hostile graphs through the real command lines and workers (processes): refused with one line, exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_parallel.graph.json_format import graph_from_dict
from support import REPO
from support.hostile_graphs import SENTINEL_NAME, corpus, graph_dict, one_stage

ROOT = REPO


@pytest.mark.slow
@pytest.mark.parametrize("name", ["getattr_chain_globals_map", "model_class_os_system", "keyword_name_source_injection"])
def test_codegen_script_in_a_subprocess_exits_2_with_one_line(name: str, tmp_path: Path) -> None:
    attempt = next(a for a in corpus(tmp_path / SENTINEL_NAME) if a.name == name)
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph_dict(attempt, tripwire=False)))  # Tripwire is unknown in a fresh process
    result = subprocess.run(
        [sys.executable, str(ROOT / "model_parallel/optimizer/convert_graph_to_model.py"), "-f", str(path),
         "-n", "Evil", "-a", "evil", "-o", str(tmp_path / "pkg")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "node evil" in lines[0] and "is not allowed in a graph file" in lines[0]
    assert not (tmp_path / SENTINEL_NAME).exists() and not (tmp_path / "pkg").exists()


def _worker(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_parallel.cli.worker", *args, "--steps", "1", "--timeout", "30"],
                          capture_output=True, text=True, timeout=180, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["getattr_chain_globals_map", "sparse_coo_heap_write"])
def test_worker_refuses_a_hostile_graph(name: str, tmp_path: Path) -> None:
    from model_parallel.runtime.launch import launch_workers

    attempt = next(a for a in corpus(tmp_path / SENTINEL_NAME) if a.name == name)
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph_dict(attempt, tripwire=False)))
    result = launch_workers(["--graph", str(path), "--steps", "1", "--timeout", "30"], 1, timeout=150)
    assert result.workers[0].returncode == 2, result.summary()
    assert "node evil" in result.output(0) and "is not allowed in a graph file" in result.output(0)
    assert not (tmp_path / SENTINEL_NAME).exists()


@pytest.mark.slow
def test_worker_refuses_a_package_with_a_hostile_graph(tmp_path: Path) -> None:
    attempt = next(a for a in corpus(tmp_path / SENTINEL_NAME) if a.name == "model_class_os_path")
    package = tmp_path / "package"
    package.mkdir()
    graph = graph_dict(attempt, tripwire=False)
    (package / "graph.json").write_text(json.dumps(graph))
    (package / "plan.json").write_text(json.dumps(one_stage(graph_from_dict(graph)).to_dict()))
    result = _worker(["--single_process", "--package", str(package)], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "node evil" in result.stderr and "is not allowed in a graph file" in result.stderr
    assert not (tmp_path / SENTINEL_NAME).exists()
