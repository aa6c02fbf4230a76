"""model_parallel.profile: the real dataflow DAG of unmodified models, per-node times, and an untouched model."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import model_parallel
from model_parallel.errors import ProfileError
from model_parallel.graph.core import Graph
from model_parallel.models import TinyGPT
from model_parallel.models.gpt import lm_loss
from model_parallel.profiler import api
from model_parallel.profiler.image_classification.classifier import build_model
from model_parallel.profiler.insitu import Instrumentation, run_steps
from model_parallel.profiler.timing import HarnessOverhead, Replay, time_training_step
from model_parallel.profiler.trace import trace_model
from support.profiling import assert_unchanged, snapshot

FAST = {"warmup": 0, "iterations": 1}


def parameter_bytes(model: nn.Module) -> float:
    return float(sum(p.numel() * p.element_size() for p in model.parameters()))


def assert_sane_graph(graph: Graph, model: nn.Module, input_bytes: float) -> None:
    """Sizes from real tensors, one source, every node reachable from it, parameters all accounted for."""
    assert sum(n.parameter_size for n in graph.nodes) == parameter_bytes(model)
    (source,) = [n for n in graph.nodes if n.layer.op == "placeholder"]
    assert source.description == "Input0" and source.activation_size == input_bytes
    assert source.forward_ms == source.backward_ms == 0.0
    for node in graph.nodes:
        if node.layer.outputs:  # tensor-valued: real bytes, dtype-aware
            expected = sum(m.numel * torch.empty((), dtype=getattr(torch, m.dtype)).element_size() for m in node.layer.outputs)
            assert node.activation_bytes == expected > 0, node.node_id
        else:  # sizes, ints, devices: no activation, no time
            assert node.activation_bytes == 0 and node.compute_ms == 0, node.node_id
        if node.layer.op == "call_module" and node.parameter_size > 0:
            assert node.forward_ms > 0 and node.backward_ms > 0, node.node_id
    reachable = set(graph.ancestors(graph.sinks[0])) | {graph.sinks[0]}
    assert all(n.node_id in reachable or not graph.predecessors[n.node_id] for n in graph.nodes)
    assert len(graph.edges) >= len(graph) - 1


def node_inputs(graph: Graph, node_id: str) -> tuple[str, ...]:
    return graph.predecessors[node_id]


def referenced(value: Any) -> list[str]:
    """Node ids referenced in an encoded argument."""
    if isinstance(value, dict):
        if set(value) == {"node"}:
            return [value["node"]]
        return [r for v in value.values() for r in referenced(v)]
    if isinstance(value, list):
        return [r for v in value for r in referenced(v)]
    return []


# ---- resnet18: residuals, in-place ReLU, `out += identity`, flatten --------------------------------
@pytest.fixture(scope="module")
def resnet18_profile():
    model = build_model("resnet18", num_classes=10, image_size=32)
    model.eval()  # profiling runs it in training mode and must put eval back ...
    model.layer1.train()  # ... and mixed modes too
    model.fc.weight.grad = torch.full_like(model.fc.weight, 0.5)  # an existing gradient must survive
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    before = snapshot(model)
    graph = model_parallel.profile(model, (x,), lambda out: F.cross_entropy(out, y), **FAST)
    return model, graph, before


def test_resnet18_structure(resnet18_profile):
    model, graph, _ = resnet18_profile
    assert len(graph) == 70 and len(graph.edges) == 77
    assert graph.sources == ("x",) and graph.sinks == ("fc",)
    assert graph.metadata["outputs"] == {"node": "fc"}
    adds = [n for n in graph.nodes if n.description == "Add()"]
    assert len(adds) == 8  # one `out += identity` per BasicBlock
    for add in adds:
        # fx records `out += identity` as an out-of-place add: same values, same dataflow edges
        assert add.layer.target == "operator.add" and len(node_inputs(graph, add.node_id)) == 2
    assert node_inputs(graph, "add") == ("layer1_0_bn2", "maxpool")  # the identity branch is a real edge
    assert node_inputs(graph, "add_2") == ("layer2_0_bn2", "layer2_0_downsample_1")
    assert node_inputs(graph, "flatten") == ("avgpool",) and graph.successors["flatten"] == ("fc",)
    assert graph["relu"].description == "ReLU(inplace=True)"
    assert_sane_graph(graph, model, input_bytes=2 * 3 * 32 * 32 * 4)


def test_resnet18_times(resnet18_profile):
    _, graph, _ = resnet18_profile
    convs = [n for n in graph.nodes if n.description.startswith("Conv2d")]
    assert len(convs) == 20 and all(n.forward_ms > 0 and n.backward_ms > 0 for n in convs)
    assert graph.total_compute_ms > sum(n.forward_ms for n in graph.nodes) > 0
    meta = graph.metadata["profile"]
    assert meta["device"] == "cpu" and meta["iterations"] == 1 and meta["warmup"] == 0
    assert meta["loss_forward_ms"] > 0 and meta["loss_backward_ms"] > 0
    assert meta["overhead_subtracted_ms"]["backward"] >= 0


def test_profiling_leaves_resnet18_unchanged(resnet18_profile):
    model, _, before = resnet18_profile
    assert not model.training and model.layer1[0].bn1.training and not model.layer2.training
    assert_unchanged(model, before)


# ---- the other torchvision families and the repo's GPT -------------------------------------------
def _concat_inputs_match_arguments(graph: Graph) -> list[int]:
    counts = []
    for node in graph.nodes:
        if node.description.startswith("Concat"):
            tensors = referenced(node.layer.args[0])
            assert node_inputs(graph, node.node_id) == tuple(dict.fromkeys(tensors)), node.node_id
            counts.append(len(tensors))
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("arch, size", [("densenet121", 32), ("inception_v3", 75), ("mobilenet_v2", 32), ("mobilenet_v3_small", 32)])
def test_torchvision_dag_capture(arch: str, size: int):
    model = build_model(arch, num_classes=10, image_size=size)
    x = torch.randn(2, 3, size, size)
    before = snapshot(model)
    graph = model_parallel.profile(model, (x,), **FAST)
    assert_unchanged(model, before)
    assert_sane_graph(graph, model, input_bytes=2 * 3 * size * size * 4)
    assert any(n.description == "Flatten(1)" for n in graph.nodes)
    if arch == "densenet121":
        counts = _concat_inputs_match_arguments(graph)
        # each of the 6+12+24+16 dense layers concatenates every earlier feature map of its block,
        # and each block ends with one more: the last of block 3 joins its input and 24 layers
        assert len(counts) == 58 + 4 and max(counts) == 25 and counts[:7] == [1, 2, 3, 4, 5, 6, 7]
    if arch == "inception_v3":
        counts = _concat_inputs_match_arguments(graph)
        assert counts.count(4) >= 4 and 3 in counts and 2 in counts  # 4-branch blocks, 3-branch reductions, nested pairs
    if arch == "mobilenet_v2":
        adds = [n for n in graph.nodes if n.description == "Add()"]
        assert len(adds) == 10 and all(len(node_inputs(graph, n.node_id)) == 2 for n in adds)
    if arch == "mobilenet_v3_small":
        scales = [n for n in graph.nodes if n.description == "Mul()"]  # squeeze-excitation: scale * input
        assert len(scales) == 9 and all(len(node_inputs(graph, n.node_id)) == 2 for n in scales)
        assert any("Hardswish" in n.description for n in graph.nodes)


def test_vgg_is_a_chain():
    # Structure only, on the meta device: vgg's 130M parameters cost seconds to initialise for real.
    with torch.device("meta"):
        model = build_model("vgg11", num_classes=10, image_size=32)
        graph, _ = model_parallel.trace_model(model, (torch.empty(1, 3, 32, 32),))
    assert len(graph) == 31 and len(graph.edges) == 30
    assert all(len(p) <= 1 for p in graph.predecessors.values())
    assert [n.node_id for n in graph.nodes] == list(graph.topological_order)
    assert "flatten" in graph and sum(n.parameter_size for n in graph.nodes) == parameter_bytes(model)


def test_tinygpt_dag_and_loss():
    model = TinyGPT(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=2)
    tokens = torch.randint(0, 64, (2, 16))
    before = snapshot(model)
    graph = model_parallel.profile(model, (tokens,), lambda logits: lm_loss(logits, tokens), **FAST)
    assert_unchanged(model, before)
    assert graph["tokens"].activation_size == 2 * 16 * 8  # int64 ids: dtype-aware bytes
    adds = [n for n in graph.nodes if n.description.startswith("Add")]
    assert len(adds) == 1 + 2 * 2  # embeddings + two residuals per block
    assert all(len(node_inputs(graph, n.node_id)) == 2 for n in adds)
    attention = [n for n in graph.nodes if n.layer.target.endswith("scaled_dot_product_attention")]
    assert len(attention) == 2 and all(len(node_inputs(graph, n.node_id)) == 3 for n in attention)
    assert all(n.compute_ms > 0 for n in attention)
    assert graph["split"].activation_size == (2 * 16 * 32 * 4.0,) * 3  # one size per output
    assert graph["size"].compute_ms == 0 and graph["size"].activation_size == 0
    # Embeddings of token ids: a weight gradient, but no gradient into the integer input.
    assert graph["token_embedding"].backward_ms > 0
    assert graph.metadata["profile"]["loss_backward_ms"] > 0
    assert_sane_graph(graph, model, input_bytes=2 * 16 * 8)


# ---- in-place operators and what real training differentiates --------------------------------------
class Residual(nn.Module):
    """The patterns that crash full backward hooks: in-place ReLU on a module output, `out += identity`."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.conv(x))
        out += identity
        out = F.relu(out, inplace=True)
        return self.fc(torch.flatten(out, 1))


def test_inplace_operators_profile_where_backward_hooks_fail():
    model = Residual()
    x = torch.randn(2, 4, 8, 8)
    hooked = copy.deepcopy(model)
    hooked.relu.register_full_backward_hook(lambda *args: None)
    with pytest.raises(RuntimeError):  # what PipeDream-style per-module backward hooks run into
        hooked(x).sum().backward()
    graph = model_parallel.profile(model, (x,), **FAST)
    assert graph.predecessors["add"] == ("relu", "x")
    assert graph["add"].layer.target == "operator.add" and graph["add"].compute_ms > 0
    assert graph["relu_1"].layer.kwargs == {"inplace": True}
    assert graph.predecessors["fc"] == ("flatten",)
    assert all(n.compute_ms > 0 for n in graph.nodes if n.layer.op != "placeholder")


class Probe(nn.Module):
    """Records whether its input tracks gradients each time it runs (profiled whole as a leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.requires_grad)
        return x * self.weight


class TwoProbes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Probe(), Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def test_gradients_flow_only_where_training_computes_them():
    model = TwoProbes()
    model_parallel.profile(model, (torch.randn(2, 3),), warmup=1, iterations=2, leaf_modules=[Probe], timing="replay")
    # one shape-recording run, then 3 replays and the real forward, then the forward that counts saved
    # bytes (profiler/saved.py, autograd on): the input image tracks no gradient, values computed from
    # parameters do.
    assert model.first.seen == [False] * 6
    assert model.second.seen == [False] + [True] * 3 + [False] + [True]
    model = TwoProbes()
    model_parallel.profile(model, (torch.randn(2, 3),), warmup=1, iterations=2, leaf_modules=[Probe], timing="insitu")
    # in situ: the shape-recording run, then 3 real training steps with autograd on, then the saved-bytes run
    assert model.first.seen == [False] * 5
    assert model.second.seen == [False] + [True] * 4


def test_replay_handles_inplace_ops_and_non_differentiable_outputs():
    replay = Replay(torch.device("cpu"), warmup=1, iterations=3)
    x = torch.randn(16, 16)
    inplace = replay.time(lambda p: p["x"].relu_(), {"x": (x, True)})
    assert inplace.forward_ms > 0 and inplace.backward_ms > 0
    argmax = replay.time(lambda p: p["x"].argmax(1), {"x": (x, True)})
    assert argmax.forward_ms > 0 and argmax.backward_ms == 0
    no_grad = replay.time(lambda p: p["x"] * 2, {"x": (x, False)})
    assert no_grad.backward_ms == 0
    assert torch.equal(x, x.clone())  # the original input is never touched (copies are replayed)


def test_replay_subtracts_overhead_but_never_below_zero():
    replay = Replay(torch.device("cpu"), warmup=0, iterations=1, overhead=HarnessOverhead(1e6, 1e6))
    timing = replay.time(lambda p: p["x"] * 2, {"x": (torch.ones(3), True)})
    assert timing.forward_ms == 0 and timing.backward_ms == 0
    with pytest.raises(ValueError, match=r"iterations must be >= 1, got 0"):
        Replay(torch.device("cpu"), warmup=0, iterations=0)


# ---- errors ----------------------------------------------------------------------------------------
class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
            return self.fc(x)
        return x


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Branchy()
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def test_untraceable_model_names_the_fix_and_leaf_modules_fix_it():
    with pytest.raises(ProfileError, match=r"torch.fx could not trace Wrapper.*leaf_modules"):
        model_parallel.profile(Wrapper(), (torch.ones(2, 3),), **FAST)
    graph = model_parallel.profile(Wrapper(), (torch.ones(2, 3),), leaf_modules=[Branchy], **FAST)
    assert [n.node_id for n in graph.nodes] == ["x", "inner", "out"]
    assert graph["inner"].parameter_size == 3 * 3 * 4 + 3 * 4


def test_bad_inputs_and_devices_are_profile_errors():
    model = nn.Linear(3, 2)
    with pytest.raises(ProfileError, match=r"Linear.forward takes 1 input\(s\) \(input\w*\) but 2 example input\(s\) were given"):
        model_parallel.profile(model, (torch.ones(1, 3), torch.ones(1, 3)), **FAST)
    with pytest.raises(ProfileError, match=r"running Linear on the example inputs \(\(1, 5\)\) failed"):
        model_parallel.profile(model, (torch.ones(1, 5),), **FAST)
    with pytest.raises(ProfileError, match=r"need warmup >= 0 and iterations >= 1, got warmup=0, iterations=0"):
        model_parallel.profile(model, (torch.ones(1, 3),), warmup=0, iterations=0)
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError, match=r"CUDA is not available"):
            model_parallel.profile(model, (torch.ones(1, 3),), device="cuda", **FAST)
    assert api.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert api.resolve_device(None, model) == torch.device("cpu")


def test_profile_is_exported_lazily():
    assert model_parallel.profile is api.profile


def test_cpu_clock_profiles_and_rejects_bad_clocks():
    model = Residual()
    graph = model_parallel.profile(model, (torch.randn(2, 4, 8, 8),), clock="cpu", **FAST)
    assert graph.metadata["profile"]["clock"] == "cpu"
    assert graph["conv"].forward_ms > 0 and graph["conv"].backward_ms > 0
    with pytest.raises(ProfileError, match=r"clock must be one of \('wall', 'cpu'\), got 'gpu'"):
        model_parallel.profile(model, (torch.randn(2, 4, 8, 8),), clock="gpu", **FAST)
    with pytest.raises(ValueError, match=r"clock 'cpu' .* cannot time cuda kernels"):
        Replay(torch.device("cuda"), warmup=0, iterations=1, clock="cpu")


# ---- in-situ timing (the default on CPU) ------------------------------------------------------------
class ForkAndSplit(nn.Module):
    """A fork (x feeds fc1 and the add), an in-place ReLU, a multi-output op with getitems."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.relu(self.fc1(x)) + x)
        a, b = h.chunk(2, dim=1)
        return a * b


def test_insitu_intervals_cover_the_backward_pass_and_every_node_that_has_backward_work():
    model = ForkAndSplit()
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 0.5)  # an existing gradient must survive
    graph, gm = trace_model(model, (torch.randn(4, 8),), route="fx")
    timed = {n.node_id for n in graph.nodes if n.layer.op.startswith("call") and n.layer.outputs}
    result = run_steps(gm, (torch.randn(4, 8),), lambda out: out.sum(), timed, warmup=1, iterations=1,
                       clock="cpu", instrumentation=Instrumentation())
    assert set(result.timings) == timed
    # who owns which autograd Node: parameters' ops, the in-place ReLU, the add at the fork, chunk;
    # getitem only picks an output of chunk's (its grad_fn is chunk's)
    for name in ("fc1", "relu", "add", "fc2", "chunk", "mul"):
        assert result.grad_fns[name] >= 1, name
        assert result.timings[name].backward_ms > 0, name
    assert result.grad_fns["getitem"] == result.grad_fns["getitem_1"] == 0
    # the stamps cut the backward pass into intervals: nodes plus loss are exactly the whole pass,
    # and the forward windows are disjoint parts of the rest of the step
    backward = sum(t.backward_ms for t in result.timings.values()) + result.loss.backward_ms
    assert backward == pytest.approx(result.backward_ms, rel=1e-9, abs=1e-9)
    forward = sum(t.forward_ms for t in result.timings.values()) + result.loss.forward_ms
    assert 0 < forward <= result.step_ms - result.backward_ms
    assert torch.equal(model.fc1.weight.grad, torch.full_like(model.fc1.weight, 0.5))
    assert model.fc2.weight.grad is None


def test_insitu_is_the_default_on_cpu_and_replay_stays_available():
    model = ForkAndSplit()
    x = torch.randn(4, 8)
    insitu = model_parallel.profile(model, (x,), lambda out: out.sum(), **FAST)
    meta = insitu.metadata["profile"]
    assert meta["timing"] == "insitu" and meta["instrumented_step_ms"] > 0
    assert insitu["fc1"].backward_ms > 0 and insitu["fc2"].forward_ms > 0
    replay = model_parallel.profile(model, (x,), lambda out: out.sum(), timing="replay", **FAST)
    assert replay.metadata["profile"]["timing"] == "replay" and replay["fc1"].backward_ms > 0
    assert "instrumented_step_ms" not in replay.metadata["profile"]
    with pytest.raises(ProfileError, match=r"timing must be one of auto, insitu, replay, got 'isolated'"):
        model_parallel.profile(model, (x,), timing="isolated", **FAST)
    assert api.timing_mode("auto", torch.device("cuda")) == "replay"
    # a store resumes node by node (the image-classification command line): only replays time node by node
    assert api.timing_mode("auto", torch.device("cpu"), resumable=True) == "replay"
    assert api.timing_mode("insitu", torch.device("cpu"), resumable=True) == "insitu"
    with pytest.raises(ProfileError, match=r"timing='insitu' runs on CPU only \(got device cuda\)"):
        api.timing_mode("insitu", torch.device("cuda"))


def test_insitu_node_times_add_up_to_a_training_step_of_large_operators():
    # Operators of milliseconds each (so neither instrumentation nor the Python between them matters)
    # and CPU time (other processes' load is not counted): the sum lands near a plain step. The bar is
    # wide on purpose; bench/models.py and bench/profiler.py hold the accuracy numbers.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(384, 384), nn.GELU(), nn.Linear(384, 384), nn.GELU(), nn.Linear(384, 10))
    x, y = torch.randn(512, 384), torch.randint(0, 10, (512,))
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    graph = model_parallel.profile(model, (x,), loss_fn, warmup=1, iterations=3, clock="cpu")
    steps = time_training_step(model, (x,), loss_fn, torch.device("cpu"), 6, "cpu")[1:]
    model.zero_grad(set_to_none=True)
    meta = graph.metadata["profile"]
    total = graph.total_compute_ms + meta["loss_forward_ms"] + meta["loss_backward_ms"]
    ratio = total / sorted(steps)[len(steps) // 2]
    assert 0.7 < ratio < 1.4, (total, steps)
    # most of a step is the three matmuls: each owns its weight gradient's work
    assert all(graph[n].backward_ms > 0.5 * graph[n].forward_ms for n in ("_0", "_2"))
