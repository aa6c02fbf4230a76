"""Rendering a graph with graphviz's `dot` (a process): SVG and PNG files."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model_parallel.graph.pipedream_format import read_graph_txt
from model_parallel.graph.render import render_graph
from support import REFERENCE_PROFILES as REFERENCE


needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")


@pytest.mark.slow  # starts a process
@needs_dot
def test_render_graph_writes_svg(tmp_path: Path):
    graph = read_graph_txt(REFERENCE / "toy_dag.graph.txt")
    out = render_graph(graph, tmp_path / "pictures" / "toy.svg", title="toy")
    text = out.read_text()
    assert out == tmp_path / "pictures" / "toy.svg"
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "test3" in text  # node descriptions are drawn
    assert (tmp_path / "pictures" / "toy.dot").exists()


@pytest.mark.slow  # starts a process
@needs_dot
def test_render_graph_png(tmp_path: Path):
    graph = read_graph_txt(REFERENCE / "toy_dag.graph.txt")
    out = render_graph(graph, tmp_path / "toy.png")
    assert out.read_bytes().startswith(b"\x89PNG")
