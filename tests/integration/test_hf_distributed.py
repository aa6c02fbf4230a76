"""Unmodified Hugging Face and timm models pipeline-trained on 2 and 4 processes equal single-process training.

For each model (tests/support/hf_zoo.py: GPT-2, BERT-MLM with a padding mask, Llama with its rotary
buffer, OPT, T5 with decoder inputs, timm ViT and EfficientNet-B0): profile, partition with the optimizer
into 2 and into 4 stages (a straight pipeline; the optimizer picks the cuts), train 10 steps with
`PipelineTrainer` on a gloo world of 2 and of 4 ranks, and compare every parameter and buffer with the
original model trained in one process (`single_process_reference`, same microbatching). One world per
size runs every model in turn (tests/support/hf_worker.py): a process start with transformers and timm
costs seconds. On the 2-rank world GPT-2 also runs with a live rebalance: the controller switches to a
plan that moves a transformer block to the other stage after step 5.

Tied variants (GPT-2, BERT-MLM, OPT embeddings = output head; T5's shared embedding) run on both worlds
with the tie split across stages: the ranks holding a copy sum its gradients, so the run still equals
single-process training of the tied model, and the copies stay bitwise identical. On the 4-rank world the
tied GPT-2 also runs with a parameter-free stage between the tie's holders (the attention-mask arithmetic
alone: the optimizer cuts such stages from noisy profiles) and with a live rebalance that moves the
embedding to another rank (the tie's holders change from ranks 0, 3 to 1, 3).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support import TESTS
import torch

from model_parallel import Hierarchy, PartitionOptions, partition, profile
from model_parallel.codegen.naming import original_state_from_stage
from model_parallel.codegen.naming import find_ties
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan, plan_from_graph, write_plan
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.trainer import single_process_reference
from support import hf_worker as worker
from support.codegen import assert_every_cut_computes_as_the_model
from support.hf_zoo import CASES, Case

pytestmark = [pytest.mark.slow]
WORLDS = (2, 4)
REBALANCE = "gpt2+rebalance"
TIED_REBALANCE = "gpt2+rebalance" + worker.TIED
PARAM_FREE = "gpt2+paramfree" + worker.TIED
WORKER = TESTS / "support" / "hf_worker.py"


def _profile(case: Case, tie: bool = False) -> Graph:
    # One microbatch, as the trainer traces it; one timed replay per node is enough for a plan.
    return profile(case.build(tie=tie), case.example(worker.BATCH // worker.MICROBATCHES),
                   lambda out, c=case: c.loss(out, _target(c)), warmup=0, iterations=1)


def _target(case: Case) -> torch.Tensor:
    return case.data.batch(0)[1][: worker.BATCH // worker.MICROBATCHES]


def _plan(graph: Graph, stages: int) -> Plan:
    # Topological cuts: Llama's graph has too many antichain states for an exact solve in a test's time.
    return partition(graph, Hierarchy.from_lists([stages]), PartitionOptions(straight_pipeline=True, cuts="topological"))


def _first_read(graph: Graph, prefix: str) -> int:
    """Position in topological order of the first read of a parameter under `prefix`."""
    return next(i for i, n in enumerate(graph.topological_order)
                if graph[n].layer.op == "get_attr" and graph[n].layer.target.startswith(prefix))


def _cut(graph: Graph, starts: list[int]) -> Plan:
    """Contiguous stages of the topological order: stage k + 1 starts at position starts[k]."""
    order = graph.topological_order
    return plan_from_graph(graph.with_stages({n: sum(i >= s for s in starts) for i, n in enumerate(order)}))


def _cut_before(graph: Graph, prefix: str) -> Plan:
    """Two stages: everything before the first read of a parameter under `prefix` is stage 0."""
    return _cut(graph, [_first_read(graph, prefix)])


def _blocks(graph: Graph, first: str) -> list[int]:
    """Four stages of GPT-2: stage 1 starts at `first`'s read, then transformer block 1, then the final norm."""
    return [_first_read(graph, first), _first_read(graph, "transformer.h.1."), _first_read(graph, "transformer.ln_f.")]


def _param_free_middle(graph: Graph) -> Plan:
    """Four stages of GPT-2 whose stage 1 is the attention-mask arithmetic alone: it starts after the position
    embedding's lookup and ends before block 0; the tie's holders are stages 0 (wte) and 3 (lm_head)."""
    order = graph.topological_order
    wpe = order[_first_read(graph, "transformer.wpe.")]
    lookup = max(order.index(n) for n in graph.successors[wpe])
    return _cut(graph, [lookup + 1, _first_read(graph, "transformer.h.0."), _first_read(graph, "transformer.h.1.")])


def _model(name: str) -> str:
    """The graph and reference a case name trains: "gpt2+rebalance+tied" -> "gpt2+tied"."""
    return name.split("+")[0] + (worker.TIED if name.endswith(worker.TIED) else "")


class Run:
    """Everything the checks need: the graphs, the plans, the reference, and the saved stage states per world."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.graphs = {name: _profile(case) for name, case in CASES.items()}
        self.plans = {(name, w): _plan(graph, w) for name, graph in self.graphs.items() for w in WORLDS}
        for name, case in CASES.items():
            if case.tie:  # the tied variant: embedding and output head on different stages
                tied = self.graphs[name + worker.TIED] = _profile(case, tie=True)
                self.plans.update({(name + worker.TIED, w): _plan(tied, w) for w in WORLDS})
        gpt2 = self.graphs["gpt2"]
        # The rebalance: block 1 starts stage 1, then (plan v1) block 0 does: a whole block changes stage.
        self.plans[(REBALANCE, 2)] = _cut_before(gpt2, "transformer.h.1.")
        self.switches = {(REBALANCE, 2): replace(_cut_before(gpt2, "transformer.h.0."), version=1)}
        # The tied rebalance: stage 0 holds the embeddings, then (plan v1) only the input's reshape: the token
        # embedding (one copy of the tie) moves from rank 0 to rank 1, its holders from ranks 0, 3 to 1, 3.
        gpt2_tied = self.graphs["gpt2" + worker.TIED]
        self.plans[(TIED_REBALANCE, 4)] = _cut(gpt2_tied, _blocks(gpt2_tied, "transformer.h.0."))
        self.switches[(TIED_REBALANCE, 4)] = replace(_cut(gpt2_tied, _blocks(gpt2_tied, "transformer.wte.")), version=1)
        self.plans[(PARAM_FREE, 4)] = _param_free_middle(gpt2_tied)
        variants = [(name, case, False) for name, case in CASES.items()]
        variants += [(name + worker.TIED, case, True) for name, case in CASES.items() if case.tie]
        self.initial = {name: case.build(tie=tie).state_dict() for name, case, tie in variants}
        self.reference: dict[str, tuple[dict[str, torch.Tensor], list[float]]] = {}
        for name, case, tie in variants:
            model = case.build(tie=tie)
            losses = single_process_reference(model, case.loss, worker.sgd, case.data, worker.config(), worker.STEPS)
            self.reference[name] = (model.state_dict(), losses)
        self.results = {w: self._launch(w) for w in WORLDS}

    def _launch(self, world: int) -> Any:
        out = self.root / f"world{world}"
        out.mkdir()
        names = [name for (name, w) in self.plans if w == world]
        for name in names:
            write_plan(self.plans[(name, world)], out / f"{name}.plan.json")
        for (name, w), switch in self.switches.items():
            if w == world:
                write_plan(switch, out / f"{name}.switch.json")
        port = free_port()
        return launch([[sys.executable, str(WORKER), str(rank), str(world), str(port), str(out), ",".join(names)]
                       for rank in range(world)], timeout=400)

    def stage_states(self, name: str, world: int) -> list[dict[str, Any]]:
        assert self.results[world].ok, self.results[world].summary()
        return [torch.load(self.root / f"world{world}" / f"{name}-rank{rank}.pt", weights_only=True)
                for rank in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_every_cut_a_plan_can_make_computes_what_the_model_computes(name: str) -> None:
    """Every two-stage cut (every third of EfficientNet's 649 nodes), not only the ones the optimizer picks
    from this run's timings, which vary with the machine's load."""
    case = CASES[name]
    made = assert_every_cut_computes_as_the_model(case.build(), case.example(worker.BATCH // worker.MICROBATCHES),
                                                  lambda out: case.loss(out, _target(case)),
                                                  stride=3 if name == "efficientnet" else 1)
    assert made > 30  # most cuts are ones a plan can make


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(tmp_path_factory.mktemp("hf_distributed"))


def _check(run: Run, name: str, world: int) -> list[dict[str, Any]]:
    model = _model(name)
    saved = run.stage_states(name, world)
    graph, (want, want_losses), initial = run.graphs[model], run.reference[model], run.initial[model]
    for rank, entry in enumerate(saved):
        # Every stage learned: a rank holding a tensor that single-process training changes changed one. A stage
        # may hold none (the optimizer may cut one of only the attention-mask arithmetic): nothing to learn there.
        mapped = original_state_from_stage(graph, entry["state"])
        learnable = [k for k, v in mapped.items() if v.is_floating_point() and not torch.equal(want[k], initial[k])]
        assert not learnable or any(not torch.equal(mapped[k], initial[k]) for k in learnable), \
            f"{name} on {world} ranks: rank {rank}'s stage did not train ({len(learnable)} tensors should have)"
    for tie in find_ties(graph):  # the copies of a tie on different ranks stayed one value, bit for bit
        paths = {path for _, path in tie.users}
        copies = [(rank, entry["state"][p]) for rank, entry in enumerate(saved) for p in paths if p in entry["state"]]
        assert all(torch.equal(copies[0][1], c) for _, c in copies), \
            f"{name} on {world} ranks: the copies of ({', '.join(tie.names)}) on ranks {[r for r, _ in copies]} differ"
    got = original_state_from_stage(graph, {k: v for e in saved for k, v in e["state"].items()})
    # Names no node reads (untied BERT's `cls.predictions.bias`, T5's `shared.weight`) stay untrained in both.
    for key in set(want) - set(got):
        assert torch.equal(want[key], initial[key]), f"{name}: {key} trained in the reference but no stage holds it"
    for key, value in got.items():
        # rtol is the check; atol only absorbs round-off on values whose true gradient is 0 (attention key
        # biases: softmax ignores a constant shift) and which therefore stay at about 1e-9.
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, key=key: f"{name} on {world} ranks: {key}: {m}")
    assert saved[-1]["losses"] == pytest.approx(want_losses, rel=1e-5)  # the last stage computes the loss
    return saved


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_training_on_several_processes_equals_single_process_training(run: Run, name: str, world: int) -> None:
    plan = run.plans[(name, world)]
    assert plan.num_stages == world and all(stage.node_ids for stage in plan.stages)
    _check(run, name, world)


@pytest.mark.timeout(900)
def test_a_live_rebalance_moving_a_transformer_block_keeps_training_exact(run: Run) -> None:
    before, after = run.plans[(REBALANCE, 2)], run.switches[(REBALANCE, 2)]
    moved = set(before.stages[0].node_ids) - set(after.stages[0].node_ids)
    assert any(run.graphs["gpt2"][n].layer.target.startswith("transformer.h.0.") for n in moved
               if run.graphs["gpt2"][n].layer.op == "get_attr")
    saved = _check(run, REBALANCE, 2)
    assert [entry["plan_version"] for entry in saved] == [1, 1]  # both ranks switched


def _holders(graph: Graph, plan: Plan) -> list[set[int]]:
    """The ranks holding a copy of each tie under `plan`."""
    return [{rank for n, _ in tie.users for rank in plan.stages[plan.stage_of[n]].ranks} for tie in find_ties(graph)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.tie])
def test_a_tied_weight_split_across_stages_trains_exactly(run: Run, name: str, world: int) -> None:
    variant = name + worker.TIED
    graph, plan = run.graphs[variant], run.plans[(variant, world)]
    assert graph.metadata["tied_parameters"], f"{name}: the tracer recorded no tie"
    assert plan.num_stages == world and any(len(ranks) > 1 for ranks in _holders(graph, plan)), f"{name}: no tie is split"
    _check(run, variant, world)


@pytest.mark.timeout(900)
def test_a_stage_without_parameters_between_the_tie_holders_trains_exactly(run: Run) -> None:
    graph, plan = run.graphs["gpt2" + worker.TIED], run.plans[(PARAM_FREE, 4)]
    assert not any(graph[n].layer.parameters for n in plan.stages[1].node_ids)
    assert _holders(graph, plan) == [{0, 3}]
    saved = _check(run, PARAM_FREE, 4)
    assert not saved[1]["state"]


@pytest.mark.timeout(900)
def test_a_live_rebalance_moving_a_tied_layer_keeps_training_exact(run: Run) -> None:
    graph = run.graphs["gpt2" + worker.TIED]
    before, after = run.plans[(TIED_REBALANCE, 4)], run.switches[(TIED_REBALANCE, 4)]
    assert _holders(graph, before) == [{0, 3}] and _holders(graph, after) == [{1, 3}]
    saved = _check(run, TIED_REBALANCE, 4)
    assert [entry["plan_version"] for entry in saved] == [1] * 4  # every rank switched
    assert "transformer_wte_weight" in saved[1]["state"] and not saved[0]["state"]  # the embedding moved to rank 1
