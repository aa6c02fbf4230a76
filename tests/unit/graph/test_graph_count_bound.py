"""A graph file's node and edge counts are bounded (graph.core.MAX_NODES / MAX_EDGES) while it is read: 1 GiB of
graph.txt lines (the file-size bound) is 10^7 nodes, ~13 GB of Node objects and minutes of parsing before anything
said no. Here the bounds are lowered so that the refusal is seen at once: the line past the bound is named, and
nothing after it is read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_parallel.errors import GraphError, GraphFormatError
from model_parallel.graph import core
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.json_format import graph_from_dict, graph_to_dict, read_graph_json
from model_parallel.graph.pipedream_format import parse_graph_txt, read_graph_txt

COSTS = "forward_compute_time=1.0, backward_compute_time=1.0, activation_size=4.0, parameter_size=0.0"


@pytest.fixture
def small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "MAX_NODES", 100)
    monkeypatch.setattr(core, "MAX_EDGES", 150)


def _nodes(count: int) -> list[str]:
    return [f"n{i} -- ReLU() -- {COSTS}" for i in range(count)]


def test_a_graph_txt_past_the_node_bound_is_refused_at_that_line(small_bounds: None) -> None:
    text = "\n".join(_nodes(101) + ["this line is never read"])
    with pytest.raises(GraphFormatError, match=r"^big.txt:101: more than 100 nodes"):
        parse_graph_txt(text, "big.txt")


def test_a_graph_txt_past_the_edge_bound_is_refused_at_that_line(small_bounds: None) -> None:
    edges = ["\tn0 -- n1" for _ in range(151)]
    with pytest.raises(GraphFormatError, match=r"^e.txt:153: more than 150 edges"):
        parse_graph_txt("\n".join(_nodes(2) + edges + ["\tgarbage"]), "e.txt")


def test_a_graph_json_past_the_bounds_is_refused_before_its_nodes_are_built(small_bounds: None, tmp_path: Path) -> None:
    data = graph_to_dict(_small_graph())
    data["nodes"] = [0] * 100_000  # not even nodes: the count refuses the file, no entry is looked at
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(data))
    with pytest.raises(GraphFormatError, match="graph.json: more than 100 nodes"):
        read_graph_json(path)
    data = graph_to_dict(_small_graph())
    data["edges"] = [["n0", "n1"]] * 151
    with pytest.raises(GraphFormatError, match="^g.json: more than 150 edges"):
        graph_from_dict(data, "g.json")


def test_the_graph_itself_refuses_past_the_bounds(small_bounds: None) -> None:
    nodes = [Node(f"n{i}", "ReLU()", 1.0, 1.0, 4.0, 0.0) for i in range(101)]
    with pytest.raises(GraphError, match="more than 100 nodes"):
        Graph(nodes=tuple(nodes), edges=())


def test_within_the_bounds_a_graph_reads_as_before(small_bounds: None, tmp_path: Path) -> None:
    path = tmp_path / "g.txt"
    path.write_text("\n".join(_nodes(100) + [f"\tn{i} -- n{i + 1}" for i in range(99)]) + "\n")
    assert len(read_graph_txt(path).nodes) == 100


def _small_graph() -> Graph:
    return Graph(nodes=(Node("n0", "ReLU()", 1.0, 1.0, 4.0, 0.0), Node("n1", "ReLU()", 1.0, 1.0, 4.0, 0.0)),
                 edges=(("n0", "n1"),))


def test_the_real_bounds_leave_room_for_real_models() -> None:
    assert core.MAX_NODES >= 1_000_000 and core.MAX_EDGES >= 2 * core.MAX_NODES
