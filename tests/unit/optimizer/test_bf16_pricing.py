"""Mixed precision priced end to end: the profiler at bf16 (autocast timing, held dtypes, recorded
precision), the cost model's wire bytes (graph/precision.py), the plan's precision and the runtime's
warning on a mismatch, and the PipeDream oracle under bf16."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from torch import nn

import model_parallel as mp
from model_parallel.errors import ConfigError, ProfileError
from model_parallel.graph.core import Graph, LayerSpec, Node, TensorMeta
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.graph.precision import plan_precision, precision_of, wire_bytes
from model_parallel.optimizer.costs import stage_costs
from model_parallel.optimizer.fidelity import Calibration, predict_stage_ms
from model_parallel.optimizer.partition import partition
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.run import Job, warn_precision_mismatch
from model_parallel.runtime.trainer import SingleProcessRunner


class _Probe(nn.Module):
    """A leaf that records whether each call ran under autocast (the trace's call does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(torch.is_autocast_enabled("cpu"))
        return x * 2.0


class _Net(nn.Module):
    """tanh (autocast leaves it alone: float32, like a residual stream) -> Linear (bf16 under autocast) -> probe -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.probe, self.fc2 = nn.Linear(16, 32), _Probe(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.probe(self.fc1(torch.tanh(x))))


def _profile(timing: str, precision: str) -> tuple[Graph, _Net, list[torch.dtype]]:
    torch.manual_seed(0)
    net, losses = _Net(), []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        losses.append(out.dtype)
        return out.pow(2).mean()

    graph = mp.profile(net, (torch.randn(8, 16),), loss_fn, timing=timing, warmup=0, iterations=2,
                       precision=precision, subtract_overhead=False, leaf_modules=[_Probe])
    return graph, net, losses


@pytest.mark.parametrize("timing", ["insitu", "replay"])
def test_a_bf16_profile_times_under_autocast_and_holds_and_sends_what_training_does(timing: str) -> None:
    fp32, fp32_net, _ = _profile(timing, "fp32")
    bf16, bf16_net, losses = _profile(timing, "bf16")
    assert fp32.metadata["profile"]["precision"] == "fp32" and bf16.metadata["profile"]["precision"] == "bf16"
    assert precision_of(bf16) == "bf16"
    # Every timed forward of the probe ran under autocast at bf16 (the trace's own call does not), none at fp32;
    # the loss got the float32 output, as the runtime's last stage gives it.
    assert bf16_net.probe.calls.count(True) >= 2 and not any(fp32_net.probe.calls)
    assert losses and set(losses) == {torch.float32}
    a, b = fp32.by_id, bf16.by_id
    # A Linear's output: autocast makes it bf16, so a stage holds half, and it crosses as it is.
    assert b["fc1"].layer.outputs[0].dtype == "bfloat16" and a["fc1"].layer.outputs[0].dtype == "float32"
    assert b["fc1"].activation_bytes == a["fc1"].activation_bytes / 2 == 8 * 32 * 2
    assert wire_bytes(b["fc1"], "bf16") == b["fc1"].activation_bytes
    # An output autocast keeps in float32: held in full, sent as bf16 (half the bytes).
    assert b["tanh"].layer.outputs[0].dtype == "float32" and b["tanh"].activation_bytes == a["tanh"].activation_bytes
    assert wire_bytes(b["tanh"], "bf16") == wire_bytes(a["tanh"], "fp32") / 2 == 8 * 16 * 2
    assert all(wire_bytes(n, "fp32") == n.activation_bytes for n in fp32.nodes)


def test_profile_refuses_an_unknown_precision() -> None:
    with pytest.raises(ProfileError, match="precision must be one of fp32, bf16, got 'fp16'"):
        mp.profile(nn.Linear(2, 2), (torch.randn(1, 2),), precision="fp16")


def _chain(precision: str = "fp32") -> Graph:
    """x -> a (float32 out) -> b (bf16 out) -> c (int64 out) -> d: three cuts of 4096 held bytes each."""
    def node(node_id: str, dtype: str, numel: int, size: int) -> Node:
        return Node(node_id, node_id, forward_ms=1.0, activation_size=float(size),
                    layer=LayerSpec("call_function", "f", outputs=(TensorMeta((numel,), dtype),)))

    nodes = (Node("x", "Input0", activation_size=4096.0), node("a", "float32", 1024, 4096), node("b", "bfloat16", 2048, 4096),
             node("c", "int64", 512, 4096), node("d", "float32", 1, 4))
    edges = (("x", "a"), ("a", "b"), ("b", "c"), ("c", "d"))
    return Graph(nodes, edges, {"profile": {"precision": precision, "clock": "wall"}})


def test_boundary_bytes_halve_for_float32_tensors_under_bf16_only() -> None:
    stage_of = {"x": 0, "a": 0, "b": 1, "c": 2, "d": 3}
    fp32 = stage_costs(_chain("fp32"), stage_of, 4)
    bf16 = stage_costs(_chain("bf16"), stage_of, 4)
    assert [c.output_bytes for c in fp32] == [4096.0, 4096.0, 4096.0, 0.0]
    assert [c.output_bytes for c in bf16] == [2048.0, 4096.0, 4096.0, 0.0]  # a is float32: half; bf16, int64: as they are
    assert [c.input_bytes for c in bf16] == [0.0, 2048.0, 4096.0, 4096.0]
    assert [c.activation_bytes for c in bf16] == [c.activation_bytes for c in fp32]  # what is held does not change
    # The precision argument overrides the profile's, and a node without dtypes keeps its bytes.
    assert stage_costs(_chain("fp32"), stage_of, 4, "bf16") == bf16
    bare = replace(_chain("bf16").by_id["a"], layer=None)
    assert wire_bytes(bare, "bf16") == bare.activation_bytes
    with pytest.raises(ConfigError, match="precision must be one of fp32, bf16, got 'int8'"):
        wire_bytes(bare, "int8")


def test_the_fidelity_send_and_receive_terms_halve_with_the_wire() -> None:
    plan = Plan(stages=(StagePlan(0, ("x", "a")), StagePlan(1, ("b", "c", "d"))))
    calibration = Calibration(link_bandwidth=1e6, clock="wall")
    fp32 = predict_stage_ms(_chain("fp32"), plan, num_microbatches=2, calibration=calibration)
    bf16 = predict_stage_ms(_chain("bf16"), plan, num_microbatches=2, calibration=calibration)
    assert fp32[0].send_ms == pytest.approx(2 * 4096 / 1e6 * 1e3) and bf16[0].send_ms == pytest.approx(fp32[0].send_ms / 2)
    assert bf16[1].send_ms == pytest.approx(fp32[1].send_ms / 2)
    assert bf16[0].compute_ms == fp32[0].compute_ms
    explicit = predict_stage_ms(_chain("fp32"), plan, num_microbatches=2, calibration=calibration, precision="bf16")
    assert explicit == bf16


def test_the_plan_records_the_precision_it_was_priced_at() -> None:
    hierarchy = Hierarchy.from_lists([2], [1e6])
    assert partition(_chain("bf16"), hierarchy).extra["precision"] == "bf16"
    fp32 = partition(_chain("fp32"), hierarchy)
    assert fp32.extra["precision"] == "fp32" and plan_precision(Plan.from_dict(fp32.to_dict())) == "fp32"
    bf16 = partition(_chain("bf16"), hierarchy)
    assert bf16.stages[0].communication_s == pytest.approx(fp32.stages[0].communication_s / 2)


def test_a_run_at_the_other_precision_than_its_plan_warns(caplog: pytest.LogCaptureFixture) -> None:
    graph = _chain("fp32")
    priced = Plan(stages=(StagePlan(0, ("x", "a", "b", "c", "d")),), extra={"precision": "fp32"})
    job = Job(graph=graph, plan=priced, model=nn.Identity(), criterion=lambda out, target: out, dataset=None)
    with caplog.at_level(logging.WARNING, logger="model_parallel.runtime.run"):
        message = warn_precision_mismatch(job, bf16=True, prefix="[rank 0 stage 0]")
    assert message is not None and "trains at bf16 (--bf16) but the plan was priced at fp32" in message
    assert "[rank 0 stage 0] this run trains at bf16" in caplog.text
    assert warn_precision_mismatch(job, bf16=False) is None
    # No record in the plan: the graph's profile decides; a graph never profiled says nothing.
    bare = replace(job, plan=replace(priced, extra={}), graph=_chain("bf16"))
    assert "priced at bf16" in warn_precision_mismatch(bare, bf16=False)
    unprofiled = replace(bare, graph=replace(graph, metadata={}))
    assert warn_precision_mismatch(unprofiled, bf16=True) is None


def test_the_pipedream_oracle_trains_under_the_same_autocast() -> None:
    # One stage: PipeDream is per-microbatch SGD; at bf16 each forward runs under autocast and the
    # loss sees the float32 output (before, the oracle ignored bf16 and trained in float32).
    r = recipe("mlp")
    model, reference = r.model(0), r.model(0)
    graph, _ = mp.trace_model(model, r.example(2))
    config = TrainConfig(batch_size=8, num_microbatches=4, schedule="pipedream", bf16=True)
    factory = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    SingleProcessRunner(graph, even_plan(graph, 1), model, r.criterion, factory, r.data(8, 0), config).train(2)
    optimizer = factory(list(reference.parameters()))
    for step in range(2):
        inputs, target = r.data(8, 0).batch(step)
        for x, y in zip(inputs[0].chunk(4), target.chunk(4)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = reference(x)
            r.criterion(out.float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
