"""The Graph/Node types: validation, order, neighbours and derived graphs."""
from __future__ import annotations

import pytest

from model_parallel.errors import GraphError
from model_parallel.graph.core import Graph, LayerSpec, Node


def _graph(edges, ids="abcde") -> Graph:
    return Graph(nodes=tuple(Node(i, f"Op{i}", 1.0, 2.0, 10.0, 5.0) for i in ids), edges=tuple(edges))


def test_topological_order_prefers_file_order_and_respects_edges():
    graph = _graph([("c", "a"), ("b", "d"), ("a", "e")], ids="abcde")
    assert graph.topological_order == ("b", "c", "a", "d", "e")
    assert graph.sources == ("b", "c") and graph.sinks == ("d", "e")
    assert graph.ancestors("e") == frozenset({"a", "c"})


def test_predecessors_keep_edge_order():
    graph = _graph([("b", "a"), ("c", "a"), ("b", "c")], ids="abc")
    assert graph.predecessors["a"] == ("b", "c")
    assert graph.successors["b"] == ("a", "c")


@pytest.mark.parametrize(
    "nodes, edges, message",
    [
        ((), (), r"graph is empty"),
        ((Node("a", "X"), Node("a", "Y")), (), r"duplicate node id 'a'"),
        ((Node("a", "X"),), (("a", "b"),), r"edge a -- b names unknown node 'b'"),
        ((Node("a", "X"), Node("b", "Y")), (("a", "b"), ("b", "a")), r"graph has a cycle: a -> b -> a"),
    ],
)
def test_invalid_graphs_raise(nodes, edges, message):
    with pytest.raises(GraphError, match=message):
        Graph(nodes=nodes, edges=edges)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"node_id": "a b"}, r"node id must be a non-empty token without spaces"),
        ({"forward_ms": -1.0}, r"node a: forward_ms must be a finite number >= 0, got -1.0"),
        ({"parameter_size": float("nan")}, r"node a: parameter_size must be a finite number"),
        ({"activation_size": (1.0, -2.0)}, r"node a: activation_size must be >= 0, got -2.0"),
        ({"stage_id": -1}, r"node a: stage_id must be >= 0"),
        ({"description": "x -- y"}, r"description may not contain ' -- '"),
    ],
)
def test_invalid_nodes_raise(kwargs, message):
    fields = {"node_id": "a", "description": "X", **kwargs}
    with pytest.raises(GraphError, match=message):
        Node(**fields)


def test_layer_spec_rejects_unknown_op():
    with pytest.raises(GraphError, match=r"layer op must be one of"):
        LayerSpec(op="call_everything", target="x")


def test_with_stages_and_stage_queries():
    graph = _graph([("a", "b"), ("b", "c")], ids="abc")
    staged = graph.with_stages({"a": 0, "b": 0, "c": 1})
    assert staged.is_partitioned and staged.num_stages == 2
    assert staged.stage_node_ids(0) == ("a", "b") and staged.stage_node_ids(1) == ("c",)
    assert not graph.is_partitioned
    with pytest.raises(GraphError, match=r"no stage given for 1 node\(s\), e.g. \['c'\]"):
        graph.with_stages({"a": 0, "b": 0})


def test_costs_and_multi_output_sizes():
    node = Node("lstm", "LSTM(4, 4)", 1.5, 2.5, (8.0, 4.0, 4.0), 64.0)
    assert node.compute_ms == 4.0
    assert node.activation_sizes == (8.0, 4.0, 4.0) and node.activation_bytes == 16.0
    assert Node("x", "Input0").is_input and not node.is_input
    assert _graph([("a", "b")], ids="ab").total_compute_ms == 6.0
