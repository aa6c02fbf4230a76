"""runtime/checkpoint/model_files.py: what a checkpoint records of its model (graph.json, an HF config.json)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from model_parallel.errors import CheckpointError
from model_parallel.graph.hf_config import HF_CONFIG
from model_parallel.graph.json_format import graph_to_dict
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.checkpoint.model_files import (
    GRAPH_FILE,
    HF_CONFIG_FILE,
    checkpoint_graph,
    checkpoint_hf_config,
    write_model_files,
)


def _graph():
    graph, _ = trace_model(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), (torch.zeros(2, 4),))
    return graph


def test_graph_round_trips_and_no_config_for_a_plain_model(tmp_path: Path) -> None:
    graph = _graph()
    assert HF_CONFIG not in graph.metadata  # traced from torch.nn, not transformers
    written = write_model_files(tmp_path, graph, nn.Linear(1, 1))
    assert written == [tmp_path / GRAPH_FILE]
    assert graph_to_dict(checkpoint_graph(tmp_path)) == graph_to_dict(graph)
    assert checkpoint_hf_config(tmp_path, graph) is None


def test_hf_config_from_the_graph_metadata(tmp_path: Path) -> None:
    graph = _graph()
    graph = replace(graph, metadata={**graph.metadata, HF_CONFIG: {"model_type": "gpt2", "architectures": ["X"]}})
    write_model_files(tmp_path, graph)
    assert json.loads((tmp_path / HF_CONFIG_FILE).read_text())["model_type"] == "gpt2"
    assert checkpoint_hf_config(tmp_path, graph) == tmp_path / HF_CONFIG_FILE


def test_missing_records_name_the_flag_to_pass(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="records no graph.json.*pass --graph GRAPH"):
        checkpoint_graph(tmp_path)
    graph = _graph()
    hf = replace(graph, metadata={**graph.metadata, "model_class": "transformers.models.gpt2.GPT2LMHeadModel"})
    with pytest.raises(CheckpointError, match="traced from transformers.*no config.json.*pass --config CONFIG"):
        checkpoint_hf_config(tmp_path, hf)


def test_a_malformed_recorded_graph_is_refused_by_the_graph_reader(tmp_path: Path) -> None:
    (tmp_path / GRAPH_FILE).write_text('{"nodes": [{"id": 1}]}')
    with pytest.raises(ValueError, match="graph"):
        checkpoint_graph(tmp_path)
