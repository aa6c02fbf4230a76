"""What a checkpoint records of its model, so `model-parallel export CKPT --out DIR` needs no other file.

    <directory>/step_<N>/graph.json    the graph the run trained (maps stage names back to the model's)
    <directory>/step_<N>/config.json   a Hugging Face model's config (`config.to_dict()`), only for one

Rank 0 writes both atomically into the step directory before the manifest, so a committed checkpoint
holds them (a pruned one loses them with its shards). They are read back as any graph file is (the
graph.json reader: data only, the layers vetted before anything is built) and as any config.json is
(transformers' `AutoConfig`: JSON, no code). The config comes from the graph's `metadata["hf_config"]`
(the profiler records it when it traces a Hugging Face model), else from the model's own `config`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from model_parallel.errors import CheckpointError
from model_parallel.fileio import atomic_write_text
from model_parallel.graph.core import Graph
from model_parallel.graph.hf_config import HF_CONFIG, hf_config_dict
from model_parallel.graph.json_format import read_graph_json, write_graph_json

GRAPH_FILE = "graph.json"
HF_CONFIG_FILE = "config.json"


def write_model_files(folder: Union[str, Path], graph: Graph, model: Any = None) -> list[Path]:
    """The graph and (for a Hugging Face model) its config.json into checkpoint step directory `folder`."""
    folder = Path(folder)
    written = [write_graph_json(graph, folder / GRAPH_FILE)]
    config = graph.metadata.get(HF_CONFIG)
    if not isinstance(config, dict):
        config = hf_config_dict(model)
    if config is not None:
        written.append(atomic_write_text(folder / HF_CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n"))
    return written


def checkpoint_graph(folder: Union[str, Path]) -> Graph:
    """The graph checkpoint step directory `folder` recorded; CheckpointError naming --graph where it has none."""
    path = Path(folder) / GRAPH_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: the checkpoint records no {GRAPH_FILE} (written by a version that did not "
                              "record the graph); pass --graph GRAPH, the graph.json the run trained")
    return read_graph_json(path)


def checkpoint_hf_config(folder: Union[str, Path], graph: Graph) -> Optional[Path]:
    """The config.json of a Hugging Face model the checkpoint in `folder` recorded; None for another model.
    CheckpointError naming --config where the graph was traced from transformers but no config was recorded."""
    path = Path(folder) / HF_CONFIG_FILE
    if path.is_file():
        return path
    traced = str(graph.metadata.get("model_class", ""))
    if traced.startswith("transformers."):
        raise CheckpointError(f"{folder}: the graph was traced from {traced} but the checkpoint records no "
                              f"{HF_CONFIG_FILE} (written by an older version); pass --config CONFIG, the Hugging Face "
                              "config.json or model directory the model was built from")
    return None
