"""Load and save a graph by file name: `.json` is graph.json, anything else graph.txt.

`load_graph("x/graph.txt")` also picks up a `graph.json` sidecar (same stem) when one sits beside
it with the same nodes, so PipeDream-format files keep the layer specs the profiler recorded.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Union

from model_parallel.errors import GraphFormatError
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import read_graph_json, write_graph_json
from model_parallel.graph.pipedream_format import read_graph_txt, write_graph_txt

PathLike = Union[str, "os.PathLike[str]"]


def sidecar_path(path: PathLike) -> Path:
    """Where the JSON sidecar of a graph.txt lives: `graph.txt` -> `graph.json`, `gpus=3.txt` -> `gpus=3.json`."""
    return Path(path).with_suffix(".json")


def load_graph(path: PathLike, use_sidecar: bool = True) -> Graph:
    path = Path(path)
    if path.suffix == ".json":
        return read_graph_json(path)
    graph = read_graph_txt(path)
    sidecar = sidecar_path(path)
    if use_sidecar and sidecar.exists():
        rich = read_graph_json(sidecar)
        if [n.node_id for n in rich.nodes] != [n.node_id for n in graph.nodes]:
            raise GraphFormatError(
                f"{sidecar}: sidecar does not describe the same nodes as {path}; "
                "regenerate it or remove it to use the text file alone"
            )
        # The text file is authoritative for costs and stages; the sidecar adds layers, what cannot
        # cross a stage boundary (graph.txt has no field for it) and metadata.
        nodes = tuple(replace(t, layer=j.layer, uncrossable=j.uncrossable, saved_bytes=j.saved_bytes) for t, j in zip(graph.nodes, rich.nodes))
        graph = replace(graph, nodes=nodes, metadata=rich.metadata)
    return graph


def save_graph(graph: Graph, path: PathLike, with_sidecar: bool = True) -> Path:
    """Write graph.txt (and its JSON sidecar) or graph.json, atomically."""
    path = Path(path)
    if path.suffix == ".json":
        return write_graph_json(graph, path)
    if with_sidecar:
        write_graph_json(graph, sidecar_path(path))
    return write_graph_txt(graph, path)
