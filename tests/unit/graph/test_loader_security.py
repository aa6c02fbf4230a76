"""A graph file never runs code: a corpus of escape attempts, each refused before anything is built.

Every attempt is a graph.json whose hostile node would, if anything from it ran, create a sentinel
file (or read one). Each graph starts with a `Tripwire` layer, a class the test registers whose
constructor records that it ran: a refused graph must leave no sentinel and no tripwire, and the
GraphFormatError must name the hostile node. The corpus runs through every path that builds layers
from a file: build_stages, full_model_from_graph, package generation, the codegen command line,
PipelineTrainer(graph), the worker (--graph, --package) and the coordinator.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from model_parallel.cli.common import run_cli
from model_parallel.codegen.build import build_stages, full_model_from_graph
from model_parallel.codegen.package import generate_package
from model_parallel.errors import GraphFormatError
from model_parallel.graph import loader
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import graph_from_dict
from model_parallel.graph.plan import Plan, StagePlan
from support.hostile_graphs import BUILT, SENTINEL_NAME, Attempt, Tripwire, _call, _module, corpus, graph_dict, one_stage

torch.set_num_threads(1)
def halve(x: torch.Tensor) -> torch.Tensor:
    """A user's helper that fx keeps as one call (wrapped): a graph names it `test_loader_security.halve`."""
    return x / 2


torch.fx.wrap("halve")


class Halving(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return halve(self.lin(x))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh class registry holding only Tripwire, restored after the test; no tripwire built yet."""
    monkeypatch.setattr(loader, "_registered_classes", {})
    monkeypatch.setattr(loader, "_registered_functions", {})
    loader.register_layer_classes(Tripwire)
    BUILT.clear()


ATTEMPTS = corpus(Path("/nonexistent") / SENTINEL_NAME)


def _hostile(attempt: Attempt, tmp_path: Path, tripwire: bool = True) -> Graph:
    rebuilt = next(a for a in corpus(tmp_path / SENTINEL_NAME) if a.name == attempt.name)
    return graph_from_dict(graph_dict(rebuilt, tripwire), f"{attempt.name}.json")


def _assert_refused(error: pytest.ExceptionInfo, tmp_path: Path) -> None:
    message = str(error.value)
    assert "node evil" in message and "is not allowed in a graph file" in message, message
    assert "\n" not in message
    assert not (tmp_path / SENTINEL_NAME).exists(), "the hostile graph ran code"
    assert BUILT == [], "layers were built before the graph was refused"


def test_corpus_is_large_and_the_skeleton_builds(registry: None, tmp_path: Path) -> None:
    assert len(ATTEMPTS) >= 20 and len({a.name for a in ATTEMPTS}) == len(ATTEMPTS)
    benign = Attempt("benign", [("evil", _call("torch.relu", {"node": "trip"}))])
    graph = graph_from_dict(graph_dict(benign), "benign.json")
    (stage,) = build_stages(graph, one_stage(graph))
    assert BUILT == ["tripwire"]  # the tripwire really fires when layers are built
    assert torch.equal(stage(torch.tensor([[-1.0, 2.0]]))[0], torch.tensor([[0.0, 2.0]]))


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=lambda a: a.name)
def test_build_stages_refuses(attempt: Attempt, registry: None, tmp_path: Path) -> None:
    graph = _hostile(attempt, tmp_path)
    with pytest.raises(GraphFormatError) as error:
        build_stages(graph, one_stage(graph))
    _assert_refused(error, tmp_path)


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=lambda a: a.name)
def test_full_model_from_graph_refuses(attempt: Attempt, registry: None, tmp_path: Path) -> None:
    with pytest.raises(GraphFormatError) as error:
        full_model_from_graph(_hostile(attempt, tmp_path))
    _assert_refused(error, tmp_path)


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=lambda a: a.name)
def test_package_generation_refuses(attempt: Attempt, registry: None, tmp_path: Path) -> None:
    graph = _hostile(attempt, tmp_path)
    with pytest.raises(GraphFormatError) as error:
        generate_package(graph, one_stage(graph), tmp_path / "pkg", "Evil", "evil")
    _assert_refused(error, tmp_path)
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=lambda a: a.name)
def test_pipeline_trainer_refuses(attempt: Attempt, registry: None, tmp_path: Path) -> None:
    from model_parallel.api.trainer import PipelineTrainer
    from model_parallel.runtime.data.batches import SyntheticData

    with pytest.raises(GraphFormatError) as error:
        PipelineTrainer(_hostile(attempt, tmp_path), lambda params: torch.optim.SGD(params, lr=0.1),
                        SyntheticData(4, (4,), 4), single_process=True)
    _assert_refused(error, tmp_path)


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=lambda a: a.name)
def test_codegen_command_line_refuses(attempt: Attempt, registry: None, tmp_path: Path,
                                      capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_parallel.cli import generate as convert_graph_to_model
    from model_parallel.optimizer.convert_graph_to_model import main

    monkeypatch.setattr(convert_graph_to_model, "configure_logging", lambda verbose: None)  # would outlive capsys
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph_dict(next(a for a in corpus(tmp_path / SENTINEL_NAME) if a.name == attempt.name))))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, ["-f", str(path), "-n", "Evil", "-a", "evil", "-o", str(tmp_path / "pkg")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # The file reader refuses over-deep JSON before the loader sees it, naming the node's key path.
    refused_by_reader = attempt.name == "deeply_nested_arguments"
    expected = ("nodes[2].layer.args", "nested deeper than") if refused_by_reader else ("node evil", "is not allowed in a graph file")
    assert len(lines) == 1 and all(text in lines[0] for text in expected), lines
    assert not (tmp_path / SENTINEL_NAME).exists() and BUILT == [] and not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("attempt", [a for a in ATTEMPTS if a.code_named], ids=lambda a: a.name)
def test_coordinator_refuses_a_hostile_graph(attempt: Attempt, registry: None, tmp_path: Path) -> None:
    from model_parallel.coordinator.server import Coordinator

    graph = _hostile(attempt, tmp_path)
    with pytest.raises(GraphFormatError) as error:
        Coordinator(graph, one_stage(graph), b"token", policy="manual")
    _assert_refused(error, tmp_path)


def test_registered_classes_and_functions_are_the_only_widening(registry: None, tmp_path: Path) -> None:
    # metadata.model_class names this module, yet its classes stay out until the process registers them.
    class Doubler(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    Doubler.__qualname__ = "Doubler"  # importable spelling: module.Doubler
    doubler = Attempt("doubler", [("evil", _module(f"{__name__}.Doubler()"))])
    graph = graph_from_dict(graph_dict(doubler), "doubler.json")
    with pytest.raises(GraphFormatError, match=rf"node evil .*module class '{__name__}.Doubler' is not allowed.*register"):
        full_model_from_graph(graph)
    loader.register_layer_classes(Doubler)
    assert torch.equal(full_model_from_graph(graph)(torch.ones(1, 4)), 2 * torch.ones(1, 4))


def test_real_models_pass_the_loader(registry: None) -> None:
    # What fx records for the repo's models (TinyGPT: sdpa via torch._C._nn, getattr(x, "shape"), ...)
    # is inside the allow-lists: the stages build and compute what the model computes.
    from model_parallel.models import TinyGPT
    from model_parallel.profiler.trace import trace_model

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, seq_len=8, dim=16, num_heads=2, num_layers=1).eval()
    tokens = torch.randint(0, 32, (2, 8))
    graph, _ = trace_model(model, (tokens,))
    rebuilt = full_model_from_graph(graph).eval()
    from model_parallel.codegen.naming import stage_state_from_original

    rebuilt.load_state_dict(stage_state_from_original(graph, model.state_dict()))
    assert torch.allclose(rebuilt(tokens), model(tokens))


def test_trainer_allows_the_functions_of_the_model_it_traced(registry: None) -> None:
    # PipelineTrainer(model) traced the model itself, so its wrapped helper is allowed; the same graph
    # loaded without the model (a file, in a fresh process) is refused, naming the helper.
    from model_parallel.api.trainer import PipelineTrainer
    from model_parallel.runtime.config import TrainConfig
    from model_parallel.runtime.data.batches import SyntheticData

    torch.manual_seed(0)
    trainer = PipelineTrainer(Halving(), lambda params: torch.optim.SGD(params, lr=0.1), SyntheticData(4, (4,), 4),
                              TrainConfig(batch_size=4, num_microbatches=2), single_process=True)
    halve_node = next(n for n in trainer.graph.nodes if n.layer.target == f"{__name__}.halve")
    assert len(list(trainer.train(1))) == 1
    loader._registered_functions.clear()
    with pytest.raises(GraphFormatError, match=rf"node {halve_node.node_id} .*function '{__name__}.halve' is not allowed"):
        full_model_from_graph(trainer.graph)


def test_torchvision_graphs_pass_the_loader(registry: None) -> None:
    # ViT records torch._assert and getattr(x, "shape"); EfficientNet torchvision's wrapped stochastic_depth.
    from model_parallel.compat import import_torchvision
    from model_parallel.profiler.trace import trace_model

    tv = import_torchvision()
    vit = tv.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=16)
    for model in (vit, tv.models.efficientnet_b0(num_classes=10)):
        graph, _ = trace_model(model.eval(), (torch.randn(1, 3, 32, 32),))
        targets = {n.layer.target for n in graph.nodes}
        assert targets & {"torch._assert", "torchvision.ops.stochastic_depth.stochastic_depth"}
        loader.check_graph(graph)  # no custom class registered: only torch.nn constructors in there
