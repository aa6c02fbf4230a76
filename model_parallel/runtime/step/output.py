"""The model's output, rebuilt from the last stage's boundary values (what the criterion is given)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree

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


def float_output(output: Any) -> Any:
    """`output` with its floating-point tensors in float32 wherever they sit (a bf16 run's model output,
    a tensor or a dict/ModelOutput/tuple of them, before the criterion)."""
    return torch.utils._pytree.tree_map(
        lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v, output)
