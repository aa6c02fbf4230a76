"""Graphviz rendering of graphs: an SVG with layer, times and sizes; a clear error when `dot` is missing."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model_parallel.errors import RenderError
from model_parallel.graph import render
from model_parallel.graph.pipedream_format import read_graph_txt
from model_parallel.graph.render import node_label, render_graph, to_dot
from support import REFERENCE_PROFILES as REFERENCE

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")


def test_node_label_shows_layer_times_and_sizes():
    node = read_graph_txt(REFERENCE / "vgg16.graph.txt")["node12"]
    label = node_label(node)
    assert label.startswith("node12\nConv2d(128, 256")
    assert f"fwd {node.forward_ms:.3f} ms, bwd {node.backward_ms:.3f} ms" in label
    assert "act 392.0 MB" in label  # 411041792 bytes


def test_partitioned_graph_is_clustered_by_stage():
    graph = read_graph_txt(REFERENCE / "vgg16_partitioned_3stages.graph.txt")
    source = to_dot(graph, "vgg16").source
    for stage in range(3):
        assert f"cluster_stage{stage}" in source and f'label="stage {stage}"' in source
    assert source.count(" -> ") == len(graph.edges)


def test_missing_dot_raises_render_error_and_keeps_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(render.shutil, "which", lambda name: None)
    graph = read_graph_txt(REFERENCE / "toy_dag.graph.txt")
    with pytest.raises(RenderError, match=r"graphviz 'dot' is not installed.*apt-get install graphviz"):
        render_graph(graph, tmp_path / "toy.svg")
    assert not (tmp_path / "toy.svg").exists()
    assert (tmp_path / "toy.dot").read_text().startswith("digraph")
