"""Arguments a trace fixed to training mode follow the stage's mode (codegen/modes.py): a stage built from the graph
computes in eval mode what the original model computes in eval mode (no dropout, attention dropout or DropPath;
BatchNorm on, and leaving, its running statistics), and in training mode bit for bit what it computed before."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.codegen.build import full_model_from_graph
from model_parallel.errors import CodegenError
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import layer_modules
from model_parallel.runtime.step.evaluate import check_deterministic


class Regularized(nn.Module):
    """Everything that behaves differently in eval mode, written as functions (no module to set .training on)."""

    def __init__(self, drop_path: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.linear(x), 0.3, self.training)
        h = self.bn(h)
        q = h.view(h.shape[0], 2, 1, 4)
        h = h + F.scaled_dot_product_attention(q, q, q, dropout_p=0.2 if self.training else 0.0).reshape(h.shape)
        if self.drop_path and self.training:  # timm's drop_path: a per-sample mask scaled by the keep probability
            keep = h.new_empty(h.shape[0], 1).bernoulli_(0.75).div_(0.75)
            h = h * keep
        return h


@pytest.mark.parametrize("route", ["fx", "export"])
def test_a_stage_in_eval_mode_computes_the_model_in_eval_mode(route):
    torch.manual_seed(0)
    model = Regularized(drop_path=route == "export")  # fx cannot trace the `if self.training` branch's bool
    x = torch.randn(6, 8)
    graph, _ = trace_model(copy.deepcopy(model), (x,), route=route)
    stage = full_model_from_graph(graph, modules=layer_modules(graph, model))
    original = copy.deepcopy(model)

    torch.manual_seed(1)  # training: the same random draws in the same order, so the same values
    want = original(x)
    torch.manual_seed(1)
    got = stage(x)
    assert torch.equal(got, want)
    assert torch.equal(model.bn.running_mean, original.bn.running_mean)  # the stage updated the same statistics

    original.eval()
    stage.eval()
    counted = int(model.bn.num_batches_tracked)
    for seed in (2, 3):  # no randomness left: any seed gives the model's eval output
        torch.manual_seed(seed)
        assert torch.equal(stage(x), original(x))
    assert int(model.bn.num_batches_tracked) == counted and torch.equal(model.bn.running_var, original.bn.running_var)


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + 0.1 * torch.randn_like(x)


def test_randomness_no_rule_knows_in_eval_mode_is_refused_before_evaluating():
    graph, _ = trace_model(Noisy(), (torch.randn(2, 4),), route="fx")
    with pytest.raises(CodegenError, match=r"cannot evaluate: .* at randn_like \(randn_like\).*in one process instead"):
        check_deterministic(graph)
    check_deterministic(trace_model(Regularized(), (torch.randn(2, 8),), route="export")[0])  # every rule knows its own
