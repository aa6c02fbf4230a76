"""Tied parameters: found by identity, recorded in the graph, kept one tensor within a stage on every
build path and one Parameter across the stages one process builds; refused loudly (naming both
parameters) on the paths that cannot keep split copies one parameter (a generated package, the
pipedream schedule). Split ties across processes: tests/integration/test_ties_distributed.py."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.api.trainer import PipelineTrainer
from model_parallel.codegen.boundary import stage_boundaries
from model_parallel.codegen.build import build_stage, build_stages, full_model_from_graph
from model_parallel.codegen.naming import original_state_from_stage, stage_state_from_original
from model_parallel.codegen.naming import find_ties
from model_parallel.codegen.package import generate_package, import_package
from model_parallel.codegen.ties import tie_lines
from model_parallel.errors import GraphError, GraphFormatError, TiedParameterError
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import graph_to_dict, read_graph_json, write_graph_json
from model_parallel.graph.plan import Plan, StagePlan, plan_from_graph
from model_parallel.models.gpt import lm_loss
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import layer_modules
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.batches import SyntheticData
from model_parallel.runtime.trainer import SingleProcessRunner, single_process_reference
from support.tied_lm import DIM, SEQ, VOCAB, TiedLM

SPLIT = r"tied parameters 'wte.weight' and 'lm_head.weight' are one tensor.*node wte on stage 0.*node lm_head on stage 1"


class FunctionalTie(nn.Module):
    """The other way to tie: read the embedding's weight in forward (fx records a get_attr node)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.mid(self.wte(tokens)), self.wte.weight)


def _tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def _traced(model: nn.Module) -> Graph:
    graph, _ = trace_model(model, (_tokens(),))
    return graph


def _plan(graph: Graph, last_stage_nodes: tuple[str, ...]) -> dict[str, int]:
    return {n: int(n in last_stage_nodes) for n in graph.topological_order}


# ---- detection and the graph record --------------------------------------------------------------
def test_ties_are_found_by_identity_and_recorded() -> None:
    torch.manual_seed(0)
    graph = _traced(TiedLM())
    assert graph.tie_groups() == (("wte.weight", "lm_head.weight"),)
    assert graph.metadata["tied_parameters"] == [["wte.weight", "lm_head.weight"]]
    # each name maps to the node using it, whichever module fx saw first
    (tie,) = find_ties(graph)
    assert tie.users == (("wte", "wte.weight"), ("lm_head", "lm_head.weight"))
    assert "tied_parameters" not in _traced(TiedLM(tie=False)).metadata


def test_a_get_attr_of_a_module_weight_is_a_tie() -> None:
    graph = _traced(FunctionalTie())
    assert graph.tie_groups() == ()  # one name only: nothing to record, but two nodes use it
    (tie,) = find_ties(graph)
    assert tie.names == ("wte.weight",) and tie.users == (("wte", "wte.weight"), ("wte_weight", "wte_weight"))


def test_graph_json_round_trips_the_ties(tmp_path) -> None:
    graph = _traced(TiedLM())
    write_graph_json(graph, tmp_path / "graph.json")
    assert read_graph_json(tmp_path / "graph.json").tie_groups() == graph.tie_groups()


@pytest.mark.parametrize("record, message", [
    ([["wte.weight", "nope.weight"]], r"metadata\.tied_parameters\[0\]: 'nope\.weight' is not a parameter or buffer of any node"),
    ([["wte.weight"]], r"metadata\.tied_parameters\[0\] must list two or more parameter names"),
    ([["wte.weight", "lm_head.weight"], ["lm_head.weight", "mid.weight"]], r"metadata\.tied_parameters\[1\]: 'lm_head\.weight' is named twice"),
    ("wte.weight", r"metadata\.tied_parameters must be a list"),
])
def test_a_bad_tie_record_is_a_format_error_naming_file_and_key(tmp_path, record, message) -> None:
    data = graph_to_dict(_traced(TiedLM()))
    data["metadata"]["tied_parameters"] = record
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(data))
    with pytest.raises(GraphFormatError, match=rf"graph\.json: {message}"):
        read_graph_json(path)
    with pytest.raises(GraphError, match=message):
        Graph(_traced(TiedLM()).nodes, (), {"tied_parameters": record})


# ---- same-stage ties stay one tensor -------------------------------------------------------------
def _sgd_step(module: nn.Module, tokens: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    output = module(tokens)
    (output[0] if isinstance(output, tuple) else output).square().mean().backward()  # a stage returns a tuple
    optimizer.step()


def test_a_model_rebuilt_from_the_graph_keeps_the_tie_and_trains_like_the_original() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    graph = _traced(model)
    full = full_model_from_graph(graph)  # fresh layers from constructor expressions: untied until re-tied
    assert full.wte.weight is full.lm_head.weight
    full.load_state_dict(stage_state_from_original(graph, model.state_dict()))
    tokens = _tokens()
    assert torch.equal(full(tokens), model(tokens))
    _sgd_step(full, tokens)
    _sgd_step(model, tokens)
    assert full.wte.weight is full.lm_head.weight
    torch.testing.assert_close(full.wte.weight, model.wte.weight, rtol=0, atol=1e-6)
    # layer_modules hands the runtime the tied objects
    modules = layer_modules(graph, full)
    assert modules["wte"].weight is modules["lm_head"].weight


def test_a_get_attr_tie_is_kept_and_its_alias_key_maps_back() -> None:
    torch.manual_seed(0)
    model = FunctionalTie()
    graph = _traced(model)
    full = full_model_from_graph(graph)  # was: an uninitialised buffer `wte_weight`, never trained
    assert full.wte_weight is full.wte.weight and isinstance(full.wte_weight, nn.Parameter)
    full.load_state_dict(stage_state_from_original(graph, model.state_dict()))
    assert torch.equal(full(_tokens()), model(_tokens()))
    assert original_state_from_stage(graph, full.state_dict()).keys() == model.state_dict().keys()


def test_stages_keep_a_same_stage_tie_after_building_and_training() -> None:
    graph = _traced(TiedLM())
    one, = build_stages(graph, {n: 0 for n in graph.topological_order})
    assert one.wte.weight is one.lm_head.weight
    first, second = build_stages(graph, _plan(graph, ("out_norm",)))
    assert first.wte.weight is first.lm_head.weight and len(list(first.parameters())) == 3
    _sgd_step(one, _tokens())
    assert one.wte.weight is one.lm_head.weight


def test_single_process_training_with_a_same_stage_tie_equals_the_plain_model() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)  # deepcopy keeps the tie
    graph = _traced(model)
    plan = Plan(stages=(StagePlan(0, tuple(n for n in graph.topological_order if n != "out_norm")),
                        StagePlan(1, ("out_norm",)))).with_default_ranks()
    config = TrainConfig(batch_size=4, num_microbatches=2)
    data = SyntheticData(4, (SEQ,), VOCAB, "tokens", seed=0)
    factory = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    runner = SingleProcessRunner(graph, plan, model, lm_loss, factory, data, config)
    losses = [r.loss for r in runner.train(4)]
    want = single_process_reference(reference, lm_loss, factory, data, config, 4)
    assert losses == pytest.approx(want, abs=1e-6)
    stage = runner.stages[0]
    assert stage.wte.weight is stage.lm_head.weight
    torch.testing.assert_close(stage.wte.weight, reference.wte.weight, rtol=0, atol=1e-6)


def test_a_trainer_rebuilding_the_model_from_its_graph_keeps_the_tie() -> None:
    graph = _traced(TiedLM())
    data = SyntheticData(4, (SEQ,), VOCAB, "tokens", seed=0)
    config = TrainConfig(batch_size=4, num_microbatches=2)
    trainer = PipelineTrainer(graph, lambda p: torch.optim.SGD(p, lr=0.1), data, config, criterion=lm_loss,
                              plan=Plan(stages=(StagePlan(0, graph.topological_order),)), single_process=True)
    reference = copy.deepcopy(trainer.model)
    losses = [r.loss for r in trainer.train(3)]
    assert losses == pytest.approx(single_process_reference(reference, lm_loss, lambda p: torch.optim.SGD(p, lr=0.1),
                                                            data, config, 3), abs=1e-6)
    stage = trainer.runner.stages[0]
    assert stage.wte.weight is stage.lm_head.weight


def test_a_generated_package_keeps_the_tie(tmp_path) -> None:
    graph = _traced(TiedLM())
    order = graph.topological_order
    plan = Plan(stages=(StagePlan(0, tuple(n for n in order if n != "out_norm")), StagePlan(1, ("out_norm",))))
    generate_package(graph, plan, tmp_path / "tied", "TiedPartitioned", "tied")
    source = (tmp_path / "tied" / "stage0.py").read_text()
    assert "self.lm_head.weight = self.wte.weight  # tied: one tensor (wte.weight, lm_head.weight)" in source
    package = import_package(tmp_path / "tied")
    stage = package.model(None)[0][0]
    assert stage.wte.weight is stage.lm_head.weight and len(list(stage.parameters())) == 3
    full = package.full_model()
    assert full.stage0.wte.weight is full.stage0.lm_head.weight


def test_generated_code_ties_a_get_attr_and_names_awkward_paths_through_get_submodule() -> None:
    graph = _traced(FunctionalTie())
    assert tie_lines(graph, graph.topological_order) == ["self.wte_weight = self.wte.weight  # tied: one tensor (wte.weight)"]

    class InSequential(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(DIM, DIM))
            self.head = nn.Linear(DIM, DIM)
            self.head.weight = self.block[0].weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(x))

    graph, _ = trace_model(InSequential(), (torch.randn(2, DIM),), leaf_modules=[nn.Sequential])
    assert graph.tie_groups() == (("block.0.weight", "head.weight"),)
    assert tie_lines(graph, graph.topological_order) == [
        "self.head.weight = self.get_submodule('block.0').weight  # tied: one tensor (block.0.weight, head.weight)"]
    full = full_model_from_graph(graph, modules={"block": nn.Sequential(nn.Linear(DIM, DIM)), "head": nn.Linear(DIM, DIM)})
    assert full.head.weight is full.block[0].weight


# ---- split ties: one Parameter in one process; refused where copies cannot be kept one -----------
def test_build_stages_keeps_a_split_tie_one_parameter() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    graph = _traced(model)
    first, second = build_stages(graph, _plan(graph, ("lm_head", "out_norm")))  # fresh layers, re-tied across stages
    assert first.wte.weight is second.lm_head.weight
    state = stage_state_from_original(graph, model.state_dict())
    for stage in (first, second):
        stage.load_state_dict(state, strict=False)
    tokens = _tokens()
    torch.testing.assert_close(second(*first(tokens))[0], model(tokens), rtol=0, atol=0)
    # a stage built alone holds its own copy (the runtime keeps the copies one parameter across ranks)
    stage_of = _plan(graph, ("lm_head", "out_norm"))
    alone = build_stage(graph, ("lm_head", "out_norm"), stage_boundaries(graph, stage_of)[1])
    assert alone.lm_head.weight.shape == (VOCAB, DIM)
    functional = _traced(FunctionalTie())
    head, tail = build_stages(functional, _plan(functional, ("wte_weight", "linear")))
    assert head.wte.weight is tail.wte_weight and isinstance(tail.wte_weight, nn.Parameter)


def test_package_generation_refuses_a_split_tie(tmp_path) -> None:
    graph = _traced(TiedLM())
    with pytest.raises(TiedParameterError, match=SPLIT + r".*a generated package's stages are separate modules"
                       r".*Put nodes wte and lm_head in one stage.*tie_word_embeddings=False"):
        generate_package(graph, plan_from_graph(graph.with_stages(_plan(graph, ("lm_head", "out_norm")))),
                         tmp_path / "split", "Split", "split")
    assert not (tmp_path / "split").exists()


def _split_trainer(schedule: str = "1f1b", **config: object) -> tuple[PipelineTrainer, nn.Module, SyntheticData]:
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)  # deepcopy keeps the tie
    data = SyntheticData(4, (SEQ,), VOCAB, "tokens", seed=0)
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    trainer = PipelineTrainer(model, factory, data, TrainConfig(batch_size=4, num_microbatches=2, schedule=schedule, **config),
                              criterion=lm_loss, plan=Plan(stages=(StagePlan(0, ("tokens", "wte", "mid", "relu")),
                                                                   StagePlan(1, ("lm_head", "out_norm")))),
                              single_process=True)
    return trainer, reference, data


def test_the_trainer_trains_a_split_tie_in_one_process_as_one_parameter() -> None:
    trainer, reference, data = _split_trainer(clip_grad=0.05)
    first, second = trainer.runner.stages
    assert first.wte.weight is second.lm_head.weight  # one Parameter in both stages ...
    assert len(trainer.runner.params) == 5  # ... stepped and counted in the norm once
    losses = [r.loss for r in trainer.train(4)]
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    config = TrainConfig(batch_size=4, num_microbatches=2, clip_grad=0.05)
    assert losses == pytest.approx(single_process_reference(reference, lm_loss, factory, data, config, 4), abs=1e-6)
    torch.testing.assert_close(first.wte.weight, reference.wte.weight, rtol=1e-5, atol=1e-6)


def test_the_pipedream_schedule_refuses_a_split_tie() -> None:
    with pytest.raises(TiedParameterError, match=SPLIT + r".*the pipedream schedule updates each stage after every "
                       r"microbatch.*use the 1f1b or gpipe schedule.*Put nodes wte and lm_head in one stage"):
        _split_trainer("pipedream")


# ---- the runtime's bookkeeping for split ties (pure parts; the collectives: test_ties_distributed.py) ---
def test_a_tie_is_stored_once_and_restored_into_a_stage_holding_only_the_other_name(tmp_path) -> None:
    from model_parallel.runtime.build.tied import expand_state, plan_ties, stored_keys, without_aliases
    from model_parallel.runtime.checkpoint import store as ckpt

    torch.manual_seed(0)
    graph = _traced(TiedLM())
    assert stored_keys(graph) == {"lm_head.weight": "wte.weight"}
    assert expand_state(graph, {"lm_head.weight": {"step": 3}}) == {"lm_head.weight": {"step": 3}, "wte.weight": {"step": 3}}
    plan = Plan(stages=(StagePlan(0, ("tokens", "wte", "mid", "relu")), StagePlan(1, ("lm_head", "out_norm")))).with_default_ranks()
    (tie,) = plan_ties(graph, plan)
    assert tie.paths == ((0, "wte.weight"), (1, "lm_head.weight")) and tie.ranks == (0, 1)
    stage_of = plan.stage_of
    boundaries = stage_boundaries(graph, stage_of)
    first = build_stage(graph, plan.stages[0].node_ids, boundaries[0])
    second = build_stage(graph, plan.stages[1].node_ids, boundaries[1])  # its own copy, other values
    for rank, stage in enumerate((first, second)):
        params, buffers = (without_aliases(part, graph) for part in ckpt.split_state(stage))
        ckpt.save_shard(tmp_path, 0, rank, params, buffers)
    ckpt.finalize(tmp_path, 0, {}, None)
    checkpoint = ckpt.load_checkpoint(tmp_path)
    assert "wte.weight" in checkpoint.param_names and "lm_head.weight" not in checkpoint.param_names + checkpoint.buffer_names
    checkpoint.load_into(second, stored_keys(graph))
    assert torch.equal(second.lm_head.weight, first.wte.weight)


def test_a_same_stage_get_attr_tie_is_a_parameter_under_both_names_in_a_shard() -> None:
    from model_parallel.runtime.build.tied import without_aliases
    from model_parallel.runtime.checkpoint.store import split_state

    graph = _traced(FunctionalTie())
    (stage,) = build_stages(graph, {n: 0 for n in graph.topological_order})
    params, buffers = split_state(stage)
    assert {"wte.weight", "wte_weight"} <= set(params) and not buffers  # was: "wte.weight" filed as a buffer
    assert "wte_weight" not in without_aliases(params, graph)
