"""A layer-by-layer profile records what autograd saves per node (`Node.saved_bytes`, profiler/saved.py
`NodeByNodeSaving`), by the regular profile's rule: known bytes on a Linear+ReLU stack, the same numbers as
the regular profile on the zoo's models, and one node's parameters materialized at a time while counting."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.profiler.api import profile
from model_parallel.runtime.build.zoo import recipe
from support.in_place import InPlaceScale

BATCH = 5


def _stack() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU())


def _saved(graph) -> dict[str, float]:
    return {n.node_id: n.saved_bytes for n in graph.nodes}


@pytest.mark.parametrize("on_meta", (False, True))
def test_layer_by_layer_saved_bytes_of_a_linear_relu_stack_are_known(on_meta: bool) -> None:
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            model = _stack()
    else:
        model = _stack()
    target = torch.randint(0, 4, (BATCH,))
    graph = profile(model, (torch.randn(BATCH, 8),), lambda out: F.cross_entropy(out, target), iterations=1,
                    warmup=0, layer_by_layer=True, subtract_overhead=False)
    # Each ReLU saves its float32 result (also the next Linear's saved input: one storage, the ReLU's); a
    # Linear saves its input (the data, or the ReLU's result) and its weight (held, not a stash): nothing new.
    assert _saved(graph) == {"input_1": 0.0, "_0": 0.0, "_1": BATCH * 16 * 4, "_2": 0.0, "_3": BATCH * 4 * 4}
    # The loss: log_softmax's result (5 x 4 float32), the int64 target, and nll_loss's 0-d total weight.
    assert graph.metadata["profile"]["loss_saved_bytes"] == BATCH * 4 * 4 + BATCH * 8 + 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ("mlp", "gpt"))
def test_layer_by_layer_and_regular_profiles_agree_on_saved_bytes(name: str) -> None:
    r = recipe(name)
    model, example = r.model(0), r.example(2)
    target = torch.zeros(model(*example).shape[:-1], dtype=torch.long)
    loss = lambda out: r.criterion(out, target)  # noqa: E731
    regular = profile(model, example, loss, iterations=1, warmup=0, subtract_overhead=False)
    walked = profile(model, example, loss, iterations=1, warmup=0, layer_by_layer=True,
                    subtract_overhead=False)
    assert _saved(walked) == _saved(regular) and sum(_saved(regular).values()) > 0
    assert walked.metadata["profile"]["loss_saved_bytes"] == regular.metadata["profile"]["loss_saved_bytes"]


@pytest.mark.slow
def test_counting_keeps_one_nodes_parameters_at_a_time() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    graph = profile(model, (torch.randn(2, 64),), lambda out: out.sum(), iterations=1, warmup=0, layer_by_layer=True,
                    subtract_overhead=False)
    one_layer = (64 * 64 + 64) * 4
    assert graph.metadata["profile"]["layer_by_layer"]["peak_parameter_bytes"] <= 2 * one_layer  # not all 6
    assert all(n.saved_bytes is not None for n in graph.nodes)



@pytest.mark.slow
def test_an_in_place_operator_is_charged_as_in_the_regular_profile() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), InPlaceScale(8), nn.Linear(8, 8), InPlaceScale(8))
    x = torch.randn(4, 8)
    common = dict(leaf_modules=[InPlaceScale], iterations=1, warmup=0, subtract_overhead=False)
    regular = profile(model, (x,), lambda out: out.sum(), **common)
    walked = profile(model, (x,), lambda out: out.sum(), layer_by_layer=True, layer_by_layer_bytes=1, **common)
    # The first Linear's output, scaled in place, is saved by the second Linear: the Linear's bytes (its
    # storage), not the in-place node's; mul_ saves its original input (a copy): the in-place node's.
    assert _saved(walked) == _saved(regular) == {"input_1": 0.0, "_0": 128.0, "_1": 128.0, "_2": 0.0, "_3": 128.0}
