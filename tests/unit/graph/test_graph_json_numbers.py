"""graph.json numbers are JSON numbers: "nan"/"inf" strings, bools and fractional counts are refused."""
from __future__ import annotations

import pytest

from model_parallel.errors import GraphFormatError
from model_parallel.graph.json_format import graph_from_dict


def _graph(**node_fields) -> dict:
    node = {"id": "x", "description": "Input0", "forward_ms": 1.0, "backward_ms": 1.0, "activation_size": 32.0,
            "parameter_size": 0.0, "stage_id": 0,
            "layer": {"op": "placeholder", "target": "x", "outputs": [{"shape": [2, 4], "dtype": "float32"}]}}
    node.update(node_fields)
    return {"schema": "model_parallel.graph", "version": 1, "metadata": {}, "nodes": [node], "edges": []}


@pytest.mark.parametrize("field, value, expected", [
    ("forward_ms", "nan", "forward_ms must be a finite number"),
    ("backward_ms", "inf", "backward_ms must be a finite number"),
    ("parameter_size", "1e3", "parameter_size must be a finite number"),
    ("activation_size", ["1", 2.0], "activation_size must be a finite number"),
    ("saved_bytes", "-inf", "saved_bytes must be a finite number"),
    ("forward_ms", True, "forward_ms must be a finite number"),
    ("stage_id", 1.7, "stage_id must be an integer"),
    ("stage_id", "1", "stage_id must be an integer"),
])
def test_a_number_field_that_is_not_a_json_number_is_refused(field: str, value, expected: str) -> None:
    with pytest.raises(GraphFormatError, match=rf"g.json: nodes\[0\]: .*{expected}"):
        graph_from_dict(_graph(**{field: value}), "g.json")


def test_a_fractional_shape_entry_is_refused() -> None:
    layer = {"op": "placeholder", "target": "x", "outputs": [{"shape": [2.7, 4], "dtype": "float32"}]}
    with pytest.raises(GraphFormatError, match=r"an output shape entry must be an integer .*2.7"):
        graph_from_dict(_graph(layer=layer), "g.json")


def test_json_numbers_read_as_before() -> None:
    graph = graph_from_dict(_graph(forward_ms=2, activation_size=[1, 2.5]), "g.json")
    assert graph["x"].forward_ms == 2.0 and graph["x"].activation_size == (1.0, 2.5)
