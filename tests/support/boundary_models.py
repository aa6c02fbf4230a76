"""A model whose stage boundary carries a module's tuple output and a module's dict, its data, and the
two-stage plan that cuts between those modules and their `getitem`s (tests/integration/test_boundaries.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan, plan_from_graph
from model_parallel.profiler.trace import trace_model

DIM, SEQ, CLASSES, BATCH = 16, 5, 4, 8


class PairDict(nn.Module):
    """Returns a dict with two tensors and an int (a custom module fx keeps as one node)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(DIM, DIM)
        self.aux = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> dict:
        return {"main": self.main(h), "aux": self.aux(h), "scale": 2}


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)  # returns (output, attention weights)
        self.pair = PairDict()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, T, DIM)
        a = self.attn(h, h, h)  # ---- the cut: `attn` and `pair` in stage 0, their getitems in stage 1
        d = self.pair(h)
        # Both tuple elements carry gradient: the weights (B, T, T) mix the dict's "aux" tensor.
        out = a[0] + torch.bmm(a[1], d["aux"]) * d["scale"]
        return self.head(out * torch.sigmoid(d["main"])).mean(1)


class TupleData:
    batch_size = BATCH

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        return (torch.randn(BATCH, SEQ, 8, generator=gen),), torch.randint(0, CLASSES, (BATCH,), generator=gen)


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def build(seed: int = 0) -> TupleNet:
    torch.manual_seed(seed)
    return TupleNet()


def traced_job(model: nn.Module) -> tuple[Graph, Plan]:
    """`model`'s graph (PairDict kept whole) and a plan cutting right after the `attn` and `pair` nodes."""
    graph, _ = trace_model(model, (torch.randn(2, SEQ, 8),), leaf_modules=(PairDict,))
    order = graph.topological_order
    last = max(order.index(n) for n in ("attn", "pair"))
    stage_of = {n: int(i > last) for i, n in enumerate(order)}
    return graph, plan_from_graph(graph.with_stages(stage_of))
