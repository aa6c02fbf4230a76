"""The one model-output decode (runtime/step/output.py), shared by the engine and single-process mode."""
from __future__ import annotations

from types import SimpleNamespace

from model_parallel.runtime.step.output import model_output


def test_the_recorded_output_structure_is_rebuilt_by_node_id():
    graph = SimpleNamespace(metadata={"outputs": {"dict": {"logits": {"node": "fc"}, "aux": {"tuple": [{"node": "h"}, 3]}}}})
    assert model_output(graph, ("h", "fc"), ["H", "FC"]) == {"logits": "FC", "aux": ("H", 3)}


def test_without_a_recorded_structure_one_output_is_bare_and_several_a_tuple():
    graph = SimpleNamespace(metadata={})  # a PipeDream-generated package records none
    assert model_output(graph, ("out0",), ["x"]) == "x"
    assert model_output(graph, ("out0", "out1"), ["x", "y"]) == ("x", "y")
