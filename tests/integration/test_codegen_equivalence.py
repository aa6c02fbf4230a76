"""Stages built from a traced graph compute exactly what the original model computes: outputs,
every parameter gradient and BatchNorm statistics, fp32 within 1e-6, at several stage counts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from model_parallel.codegen.boundary import stage_boundaries
from model_parallel.codegen.build import build_stage, build_stages, full_model_from_graph
from model_parallel.codegen.naming import stage_state_from_original
from model_parallel.compat import import_torchvision
from model_parallel.models.gpt import TinyGPT, lm_loss
from model_parallel.models.mlp import StackedMLP
from model_parallel.profiler.trace import trace_model
from support.codegen import assert_equivalent, contiguous_split, split_before

torch.set_num_threads(1)


def _projection_loss(shape: tuple[int, ...]):
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return lambda out: (out * weights).sum()


def _vision(name: str, size: int, **kwargs) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = getattr(import_torchvision().models, name)(num_classes=10, **kwargs)
    if name == "vgg11":  # the stock classifier has 120M parameters; the features are what matters here
        model.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 32), nn.ReLU(True), nn.Dropout(), nn.Linear(32, 10))
    return model.train(), torch.randn(2, 3, size, size)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,size,stage_counts",
    [
        ("resnet18", 32, (1, 2, 3)),
        ("vgg11", 32, (2, 3)),
        ("densenet121", 32, (3,)),
        ("mobilenet_v2", 32, (2, 4)),
        ("mobilenet_v3_small", 32, (3,)),
    ],
)
def test_torchvision_stages_match_original(name: str, size: int, stage_counts: tuple[int, ...]) -> None:
    model, x = _vision(name, size)
    graph, _ = trace_model(model, (x,))
    loss = _projection_loss((2, 10))
    for num_stages in stage_counts:
        stages = build_stages(graph, contiguous_split(graph, num_stages))
        assert len(stages) == num_stages
        assert_equivalent(graph, model, stages, (x,), loss)


@pytest.mark.slow
def test_split_inside_residual_block_sends_several_tensors() -> None:
    model, x = _vision("resnet18", 32)
    graph, _ = trace_model(model, (x,))
    # Cut after layer2.0's first conv (the block input still waits for the downsample and the add),
    # and right before layer2.1's relu (an in-place ReLU on a received activation).
    stage_of = split_before(graph, ["layer2_0_bn1", "layer2_1_relu"])
    boundaries = stage_boundaries(graph, stage_of)
    assert boundaries[1].inputs == ("layer1_1_relu_1", "layer2_0_conv1")
    assert len(boundaries[1].outputs) >= 2
    stages = build_stages(graph, stage_of)
    assert "clone" in stages[2].code  # the received input is cloned before the in-place relu
    assert_equivalent(graph, model, stages, (x,), _projection_loss((2, 10)))


class _TopkRouter(nn.Module):
    """Mixtral's router in small: topk's values are normalised in place."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.out = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).softmax(-1)
        values, indices = torch.topk(scores, 2)
        values.div_(values.sum(-1, keepdim=True))
        return self.out(x) * values[:, :1] + scores.gather(-1, indices).sum(-1, keepdim=True)


def test_a_received_tuple_modified_in_place_through_getitem_is_cloned_element_by_element() -> None:
    """A cut right after topk sends (values, indices) as one tuple; the next stage divides values in place,
    so it clones each element on entry (a `.clone()` of the tuple itself raised on the worker)."""
    torch.manual_seed(0)
    model, x = _TopkRouter(), torch.randn(4, 8)
    graph, _ = trace_model(model, (x,))
    order = graph.topological_order
    topk = next(n for n in order if "topk" in graph[n].layer.target)
    stage_of = split_before(graph, [order[order.index(topk) + 1]])
    stages = build_stages(graph, stage_of)
    assert topk in stages[1].input_names and len(graph[topk].layer.outputs) == 2
    assert "clone" in stages[1].code
    assert_equivalent(graph, model, stages, (x,), lambda out: (out ** 2).sum())


class _PassThroughs(nn.Module):
    """Modules and calls that hand back their input itself (Identity, a dropout at p = 0, a cast to the dtype it has)
    right before an in-place op: a stage that starts at one of them receives the tensor the in-place op modifies."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.ident, self.act = nn.Linear(8, 8), nn.Identity(), nn.ReLU(inplace=True)
        self.drop, self.lin2 = nn.Dropout(0.0), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.ident(self.lin1(x)))
        y = self.drop(x * 1.0).mul_(2)  # (relu's backward needs its own output unmodified)
        z = torch.nn.functional.dropout(y, 0.0, True).to(torch.float32).add_(1)
        return self.lin2(z)


def test_a_stage_that_starts_at_a_pass_through_clones_what_an_in_place_op_modifies() -> None:
    # timm resnet18's default 7-stage split started a stage at `drop_block` (an Identity) before an in-place ReLU:
    # "a view of a leaf Variable that requires grad is being used in an in-place operation" at the first step.
    torch.manual_seed(0)
    model, x = _PassThroughs().train(), torch.randn(4, 8)
    graph, _ = trace_model(model, (x,))
    order = graph.topological_order
    starts = [n for n in order if graph[n].layer.op != "placeholder" and
              (graph[n].layer.target in ("ident", "drop") or "dropout" in graph[n].layer.target)]
    assert len(starts) == 3
    for start in starts:
        stages = build_stages(graph, split_before(graph, [start]))
        assert "clone" in stages[1].code, start
        assert_equivalent(graph, model, stages, (x,), lambda out: (out ** 2).sum())


def test_tinygpt_stages_match_original_at_every_stage_count() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, seq_len=8, dim=16, num_heads=2, num_layers=2)
    tokens = torch.randint(0, 32, (2, 8))
    targets = torch.randint(0, 32, (2, 8))
    graph, _ = trace_model(model, (tokens,))
    loss = lambda logits: lm_loss(logits, targets)  # noqa: E731
    for num_stages in (1, 2, 3, len(graph)):
        stages = build_stages(graph, contiguous_split(graph, num_stages))
        assert_equivalent(graph, model, stages, (tokens,), loss)


def test_every_layer_its_own_stage_for_an_mlp() -> None:
    torch.manual_seed(0)
    model = StackedMLP(in_features=8, width=16, depth=3, num_classes=4)
    x = torch.randn(4, 8)
    graph, _ = trace_model(model, (x,))
    stages = build_stages(graph, {n: i for i, n in enumerate(graph.topological_order)})
    assert len(stages) == len(graph)
    assert_equivalent(graph, model, stages, (x,), lambda out: (out ** 2).sum())


def test_full_model_from_graph_returns_the_original_structure() -> None:
    model, x = _vision("resnet18", 32)
    model.eval()
    graph, _ = trace_model(model, (x,))
    full = full_model_from_graph(graph)
    full.load_state_dict(stage_state_from_original(graph, model.state_dict()), strict=True)
    full.eval()
    with torch.no_grad():
        torch.testing.assert_close(full(x), model(x), atol=1e-6, rtol=1e-6)


def test_migration_hands_over_module_objects() -> None:
    model, x = _vision("resnet18", 32)
    graph, _ = trace_model(model, (x,))
    before = build_stages(graph, contiguous_split(graph, 2))
    after_split = contiguous_split(graph, 3)
    modules = dict(before[0].named_children()) | dict(before[1].named_children())
    after = build_stages(graph, after_split, modules=modules)
    (holder,) = [stage for stage in after if hasattr(stage, "layer2_0_conv1")]
    assert holder.layer2_0_conv1 is modules["layer2_0_conv1"]
    held = {name for stage in after for name, _ in stage.named_children()}
    assert all(getattr(s, n) is modules[n] for s in after for n, _ in s.named_children())
    assert held == set(modules)


def test_source_model_supplies_modules_without_constructor() -> None:
    class Scale(nn.Module):  # its repr is not its constructor: the graph records module=None
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = Scale()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale(self.lin(x))

    model = Model()
    graph, _ = trace_model(model, (torch.randn(2, 3),), leaf_modules=[Scale])
    assert graph["scale"].layer.module is None
    boundary = stage_boundaries(graph, {n: 0 for n in graph.topological_order})[0]
    stage = build_stage(graph, graph.topological_order, boundary, source_model=model)
    assert stage.scale is model.scale
    x = torch.randn(2, 3)
    stage.load_state_dict(stage_state_from_original(graph, model.state_dict()))
    torch.testing.assert_close(stage(x)[0], model(x))
