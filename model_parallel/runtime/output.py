"""The model's output, rebuilt from the last stage's boundary values (what the criterion is given)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from model_parallel.graph.arguments import decode_argument
from model_parallel.graph.core import Graph


def model_output(graph: Graph, output_names: Sequence[str], outputs: Sequence[Any]) -> Any:
    """The value the original model returned: the graph's recorded output structure (a tuple, a dict,
    a nested list) filled with the last stage's outputs, named by node id. A graph that records none
    (PipeDream packages) returns its one output bare, several as a tuple."""
    encoded = graph.metadata.get("outputs")
    if encoded is None:
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    values = dict(zip(output_names, outputs))
    return decode_argument(encoded, lambda ref: values[ref])
