"""A graph traced at one microbatch size, run at another: checked before any rank starts.

A profile records its inputs' shapes, and a graph captured by torch.export (Hugging Face models) keeps the traced
microbatch size in its reshapes (`view(4, 64, 192)`): run at another size it failed at step 0, deep in a stage, as
"shape '[4, 64, 192]' is invalid", and a resume failed the same way. fx traces (torchvision, the zoo) keep sizes
symbolic and run at any size; for the others the question is asked of the graph itself: the whole model, built
on meta (no memory, no compute), runs one forward at the run's microbatch size.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from model_parallel.errors import ConfigError
from model_parallel.graph.core import Graph


def traced_microbatch(graph: Graph) -> int:
    """The batch dimension the graph's first input was traced at (0: the profile recorded none)."""
    inputs = graph.metadata.get("inputs") or []
    first = inputs[0] if inputs and isinstance(inputs[0], Mapping) else {}
    shape = first.get("shape") or []
    return int(shape[0]) if shape and isinstance(shape[0], int) else 0


def check_microbatch(graph: Graph, model: nn.Module, batch_size: int, num_microbatches: int, where: str) -> None:
    """Refuse, naming both sizes and the fix, a microbatch size `model` (built from `graph` on meta) cannot run."""
    traced, micro = traced_microbatch(graph), batch_size // num_microbatches
    # fx's symbolic trace keeps sizes symbolic (x.size(0) is a node), so only an export-route graph (or one of
    # unknown origin) is tried: the trial costs a second or more per rank, at every start.
    if not traced or traced == micro or graph.metadata.get("route") == "fx":
        return
    failure = _trial(model, graph, micro)
    # A model that fails on meta at its own traced size too says nothing about sizes (an op without a meta kernel).
    if failure is None or _trial(model, graph, traced) is not None:
        return
    raise ConfigError(
        f"{where}: the model was traced at microbatches of {traced} sample(s) and does not run at this run's "
        f"{micro} (batch size {batch_size} / {num_microbatches} microbatches: {failure}); give batch size "
        f"{traced * num_microbatches} ({traced} x {num_microbatches} microbatches), or profile again at batch size "
        f"{micro}")


def _trial(model: nn.Module, graph: Graph, micro: int) -> Optional[str]:
    """Why one forward of `model` on meta inputs of `micro` samples fails (None: it runs, or cannot be tried)."""
    records: Sequence[Mapping[str, Any]] = graph.metadata.get("inputs") or []
    try:
        inputs = [torch.zeros([micro, *r["shape"][1:]], dtype=getattr(torch, str(r["dtype"])), device="meta")
                  for r in records]
    except (KeyError, TypeError, AttributeError, RuntimeError):
        return None  # inputs the profile did not record fully: nothing to try them with
    training = model.training
    model.eval()  # no running statistics updated by the trial
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as error:  # any failure: the caller tells a size from an op that meta cannot run
        return str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    finally:
        model.train(training)
    return None
