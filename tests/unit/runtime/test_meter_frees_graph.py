"""The StashMeter's pack hook must not keep a microbatch's graph alive after a split backward (I then W, both
retaining the graph): a saved output packed as itself made a cycle through autograd that leaked every graph
under zero bubble (bench/big_model.py --schedule zbh1 ran out of memory on its last stage)."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import torch
from torch import nn

from model_parallel.runtime.observe.memory_probe import StashMeter
from model_parallel.runtime.step.backward_split import backward_input, backward_weight


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # Tanh saves its own output


def _split_step(stage: nn.Module, meter: StashMeter) -> tuple[list[bool], list[torch.Tensor]]:
    """One microbatch, F then I then W under the meter; whether its saved outputs outlive it, and the gradients."""
    x = torch.randn(4, 8, requires_grad=True)
    with meter.step(stage):
        meter.begin(0)
        hidden = stage[1](stage[0](x))
        loss = stage[2](hidden).exp().sum()  # exp saves its output too
        meter.kept(0, SimpleNamespace(inputs=[x], outputs=[loss], weights=None))
        saved = [weakref.ref(hidden)]
        del hidden
        input_grads, work = backward_input([loss], [None], [x], list(stage.parameters()))
        assert input_grads[0] is not None
        backward_weight(work)
        meter.release(0)
    del work, loss, x, input_grads
    gc.collect()
    return [ref() is not None for ref in saved], [p.grad.clone() for p in stage.parameters()]


def test_a_metered_split_backward_frees_the_graph_and_matches_an_unmetered_one() -> None:
    stage = _stage()
    alive, metered = _split_step(stage, StashMeter(torch.device("cpu")))
    assert alive == [False]
    stage.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same input again
    stage_plain = _stage()
    x = torch.randn(4, 8, requires_grad=True)
    stage_plain[2](stage_plain[1](stage_plain[0](x))).exp().sum().backward()
    for got, want in zip(metered, (p.grad for p in stage_plain.parameters())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
