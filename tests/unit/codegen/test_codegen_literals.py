"""graph.txt descriptions and literals the converter used to crash on: a GraphFormatError naming the node and the
form expected, never a raw ValueError; non-finite floats printed so the generated package imports."""
from __future__ import annotations

import math

import pytest
import torch

from model_parallel.codegen.infer import infer_layers
from model_parallel.errors import GraphFormatError
from model_parallel.graph.loader import literal_source, parse_constructor
from model_parallel.graph.pipedream_format import parse_graph_txt

COSTS = "forward_compute_time=1.0, backward_compute_time=2.0, activation_size=2048.0, parameter_size=576.0"


def _two_inputs_into(description: str, stage: str = "") -> str:
    return (f"n1 -- Input0 -- {COSTS}{stage}\nn2 -- ReLU() -- {COSTS}{stage}\nn3 -- ReLU() -- {COSTS}{stage}\n"
            f"n4 -- {description} -- {COSTS}{stage}\n\tn1 -- n2\n\tn1 -- n3\n\tn2 -- n4\n\tn3 -- n4\n")


@pytest.mark.parametrize("description, message", [
    ("Concat(1, 2)", r"node n4 \('Concat\(1, 2\)'\): Concat\(d\) takes exactly one literal argument, got 2 .* Concat\(1\)"),
])
def test_concat_with_two_dims_names_the_form(description: str, message: str) -> None:
    with pytest.raises(GraphFormatError, match=message):
        infer_layers(parse_graph_txt(_two_inputs_into(description)))


@pytest.mark.parametrize("description, count", [("__getitem__()", 0), ("__getitem__(1, 2)", 2)])
def test_getitem_needs_one_index(description: str, count: int) -> None:
    text = f"n1 -- Input0 -- {COSTS}\nn2 -- {description} -- {COSTS}\n\tn1 -- n2\n"
    with pytest.raises(GraphFormatError, match=rf"__getitem__\(k\) takes exactly one literal argument, got {count}"):
        infer_layers(parse_graph_txt(text))


def test_concat_without_a_dim_still_concatenates_on_dim_1() -> None:
    graph = infer_layers(parse_graph_txt(_two_inputs_into("Concat")))
    assert graph["n4"].layer.args[1] == 1


@pytest.mark.parametrize("value", [-math.inf, math.inf, math.nan, (1.0, -math.inf), [math.inf], {"a": math.nan},
                                   complex(math.inf, 1.0), (math.inf,)])
def test_non_finite_literals_evaluate(value: object) -> None:
    source = literal_source(value)
    assert "inf" not in source.replace("float('inf')", "").replace("float('-inf')", "")
    assert repr(eval(source, {"__builtins__": {"float": float, "complex": complex}})) == repr(value)


def test_hardtanh_with_infinite_bounds_is_printed_as_loadable_source() -> None:
    source = parse_constructor("torch.nn.Hardtanh(min_val=-1e999, max_val=1e999)").source
    assert source == "torch.nn.Hardtanh(min_val=float('-inf'), max_val=float('inf'))"
    module = eval(source, {"torch": torch, "float": float})  # the generated package's own text: no NameError
    assert (module.min_val, module.max_val) == (-math.inf, math.inf)


def test_a_5000_digit_stage_id_is_a_format_error() -> None:
    text = f"n1 -- Input0 -- {COSTS} -- stage_id={'9' * 5000}\n"
    with pytest.raises(GraphFormatError, match=r"g\.txt:1: stage_id has 5000 digits.*like stage_id=0"):
        parse_graph_txt(text, "g.txt")
