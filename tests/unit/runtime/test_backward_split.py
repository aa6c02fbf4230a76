"""The backward split (I then W) gives the plain backward's gradients, and W does not redo the input path."""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model_parallel.runtime.step.backward_split import backward_input, backward_weight

COUNT = {"input": 0, "weight": 0}


class _Counted(torch.autograd.Function):
    """Identity whose backward counts itself under `name` (which path autograd ran)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        COUNT[ctx.name] += 1
        return grad, None


class Counted(nn.Module):
    """x * w with a counted node on the input path and one on the weight path (bench/emulated.py's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Counted.apply(x, "input") * _Counted.apply(self.weight, "weight")


class Tied(nn.Module):
    """One Linear used twice (a weight reached from two intermediates, one above the other), and a side branch
    of parameters only (an output no input leads to)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.bias = nn.Linear(6, 6), nn.LayerNorm(6), nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(torch.relu(self.norm(self.lin(x)))), self.bias * 2.0


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6), nn.LayerNorm(6), Counted(), Counted())


def _outputs(module: nn.Module, x: torch.Tensor, recompute: bool, bf16: bool) -> list[torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = checkpoint(module, x, use_reentrant=False) if recompute else module(x)
    return [o.float() for o in out] if isinstance(out, tuple) else [out.float()]


def _both(make: Callable[[], nn.Module], x_grad: bool, recompute: bool = False,
          bf16: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    module = make()
    split_module = copy.deepcopy(module)
    x = torch.randn(3, 6)
    grads = None
    results = []
    for m, split in ((module, False), (split_module, True)):
        xs = x.clone().requires_grad_(x_grad)
        outs = _outputs(m, xs, recompute, bf16)
        if grads is None:
            grads = [torch.randn_like(o) for o in outs]
        if split:
            dx, work = backward_input(outs, grads, [xs], m.parameters())
            assert all(p.grad is None for p in m.parameters()), "I must not touch the weights' gradients"
            backward_weight(work)
            input_grads = [g for g in dx if g is not None]
        else:
            torch.autograd.backward(outs, grads)
            input_grads = [xs.grad] if x_grad else []
        results.append(([p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()], input_grads))
    (plain_w, plain_x), (split_w, split_x) = results
    return plain_w, split_w, plain_x, split_x


@pytest.mark.parametrize("x_grad", [True, False], ids=["inner_stage", "first_stage"])
@pytest.mark.parametrize("recompute,bf16", [(False, False), (True, False), (False, True)], ids=["plain", "recompute", "bf16"])
@pytest.mark.parametrize("make", [_mlp, Tied], ids=["mlp", "tied"])
def test_split_gives_the_plain_gradients(make: Callable[[], nn.Module], x_grad: bool, recompute: bool, bf16: bool) -> None:
    plain_w, split_w, plain_x, split_x = _both(make, x_grad, recompute, bf16)
    assert len(plain_x) == len(split_x) == (1 if x_grad else 0)
    for a, b in zip(plain_x + plain_w, split_x + split_w):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in split_w)


def test_weight_pass_does_not_redo_the_input_path() -> None:
    layers = 4
    torch.manual_seed(0)
    model = nn.Sequential(*[Counted() for _ in range(layers)])
    x = torch.randn(6, requires_grad=True)
    out = model(x)
    COUNT.update(input=0, weight=0)
    _, work = backward_input([out], [torch.ones(6)], [x], model.parameters())
    assert COUNT == {"input": layers, "weight": 0}
    backward_weight(work)
    assert COUNT == {"input": layers, "weight": layers}
    assert all(p.grad is not None for p in model.parameters())


class PassThrough(nn.Module):
    """Hands its input on unchanged beside a computed output (a skip connection across a cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.lin(x)


class NoWeights(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3.0


@pytest.mark.parametrize("make", [PassThrough, NoWeights], ids=["pass_through", "no_weights"])
def test_split_of_odd_stages(make: Callable[[], nn.Module]) -> None:
    plain_w, split_w, plain_x, split_x = _both(make, x_grad=True)
    for a, b in zip(plain_x + plain_w, split_x + split_w):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_w_accumulates_into_the_gradients_in_place_and_keeps_what_it_lists() -> None:
    # A second microbatch's W adds into the .grad storage the first one made (AccumulateGrad, as a plain backward
    # does), instead of holding every weight's new gradient beside it; and the work lists the gradients it keeps.
    torch.manual_seed(0)
    module = _mlp()
    works = []
    for _ in range(2):
        x = torch.randn(3, 6, requires_grad=True)
        _, work = backward_input([module(x)], [torch.ones(3, 6)], [x], module.parameters())
        kept = list(work.gradients())
        assert kept and all(isinstance(g, torch.Tensor) for g in kept)
        works.append(work)
    backward_weight(works[0])
    storages = {id(p): p.grad.untyped_storage().data_ptr() for p in module.parameters() if p.grad is not None}
    first = {id(p): p.grad.clone() for p in module.parameters() if p.grad is not None}
    backward_weight(works[1])
    assert storages and all(p.grad.untyped_storage().data_ptr() == storages[id(p)]
                            for p in module.parameters() if id(p) in storages)
    assert any(not torch.equal(p.grad, first[id(p)]) for p in module.parameters() if id(p) in first)
