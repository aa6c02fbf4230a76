"""Unmodified Hugging Face and timm models pipeline-trained on 2 and 4 processes equal single-process training.

For each model (tests/support/hf_zoo.py: GPT-2, BERT-MLM with a padding mask, Llama with its rotary
buffer, OPT, T5 with decoder inputs, timm ViT and EfficientNet-B0): profile, partition with the optimizer
into 2 and into 4 stages (a straight pipeline; the optimizer picks the cuts), train 10 steps with
`PipelineTrainer` on a gloo world of 2 and of 4 ranks, and compare every parameter and buffer with the
original model trained in one process (`single_process_reference`, same microbatching). One world per
size runs every model in turn (tests/support/hf_worker.py): a process start with transformers and timm
costs seconds. On the 2-rank world GPT-2 also runs with a live rebalance: the controller switches to a
plan that moves a transformer block to the other stage after step 5.

Tied variants (GPT-2, BERT-MLM, OPT embeddings = output head; T5's shared embedding) run on the 2-rank
world with the tie split across the two stages: the ranks holding a copy sum its gradients, so the run
still equals single-process training of the tied model, and the copies stay identical.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from model_parallel import Hierarchy, PartitionOptions, partition, profile
from model_parallel.codegen.naming import original_state_from_stage
from model_parallel.codegen.naming import find_ties
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan, plan_from_graph, write_plan
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.trainer import single_process_reference
from support import hf_worker as worker
from support.hf_zoo import CASES, Case

pytestmark = [pytest.mark.slow]
WORLDS = (2, 4)
REBALANCE = "gpt2+rebalance"
WORKER = Path(__file__).parent / "support" / "hf_worker.py"


def _profile(case: Case, tie: bool = False) -> Graph:
    # One microbatch, as the trainer traces it; one timed replay per node is enough for a plan.
    return profile(case.build(tie=tie), case.example(worker.BATCH // worker.MICROBATCHES),
                   lambda out, c=case: c.loss(out, _target(c)), warmup=0, iterations=1)


def _target(case: Case) -> torch.Tensor:
    return case.data.batch(0)[1][: worker.BATCH // worker.MICROBATCHES]


def _plan(graph: Graph, stages: int) -> Plan:
    # Topological cuts: Llama's graph has too many antichain states for an exact solve in a test's time.
    return partition(graph, Hierarchy.from_lists([stages]), PartitionOptions(straight_pipeline=True, cuts="topological"))


def _cut_before(graph: Graph, prefix: str) -> Plan:
    """Two stages: everything before the first read of a parameter under `prefix` is stage 0."""
    order = graph.topological_order
    first = next(i for i, n in enumerate(order) if graph[n].layer.op == "get_attr" and graph[n].layer.target.startswith(prefix))
    return plan_from_graph(graph.with_stages({n: int(i >= first) for i, n in enumerate(order)}))


class Run:
    """Everything the checks need: the graphs, the plans, the reference, and the saved stage states per world."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.graphs = {name: _profile(case) for name, case in CASES.items()}
        self.plans = {(name, w): _plan(graph, w) for name, graph in self.graphs.items() for w in WORLDS}
        for name, case in CASES.items():
            if case.tie:  # the tied variant, on 2 ranks: embedding and output head on different stages
                tied = self.graphs[name + worker.TIED] = _profile(case, tie=True)
                self.plans[(name + worker.TIED, 2)] = _plan(tied, 2)
        gpt2 = self.graphs["gpt2"]
        # The rebalance: block 1 starts stage 1, then (plan v1) block 0 does: a whole block changes stage.
        self.plans[(REBALANCE, 2)] = _cut_before(gpt2, "transformer.h.1.")
        self.switch = replace(_cut_before(gpt2, "transformer.h.0."), version=1)
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
        if world == 2:
            write_plan(self.switch, out / f"{REBALANCE}.switch.json")
        port = free_port()
        return launch([[sys.executable, str(WORKER), str(rank), str(world), str(port), str(out), ",".join(names)]
                       for rank in range(world)], timeout=400)

    def stage_states(self, name: str, world: int) -> list[dict[str, Any]]:
        assert self.results[world].ok, self.results[world].summary()
        return [torch.load(self.root / f"world{world}" / f"{name}-rank{rank}.pt", weights_only=True)
                for rank in range(world)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(tmp_path_factory.mktemp("hf_distributed"))


def _check(run: Run, name: str, world: int) -> list[dict[str, Any]]:
    model = name if name in run.graphs else name.split("+")[0]
    saved = run.stage_states(name, world)
    graph, (want, want_losses), initial = run.graphs[model], run.reference[model], run.initial[model]
    for rank, entry in enumerate(saved):
        # Every stage learned: some tensor of each moved from its initial value.
        mapped = original_state_from_stage(graph, entry["state"])
        assert any(not torch.equal(v, initial[k]) for k, v in mapped.items() if v.is_floating_point()), \
            f"{name} on {world} ranks: rank {rank}'s stage did not train"
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
    before, after = run.plans[(REBALANCE, 2)], run.switch
    moved = set(before.stages[0].node_ids) - set(after.stages[0].node_ids)
    assert any(run.graphs["gpt2"][n].layer.target.startswith("transformer.h.0.") for n in moved
               if run.graphs["gpt2"][n].layer.op == "get_attr")
    saved = _check(run, REBALANCE, 2)
    assert [entry["plan_version"] for entry in saved] == [1, 1]  # both ranks switched


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.tie])
def test_a_tied_weight_split_across_stages_trains_exactly(run: Run, name: str) -> None:
    variant = name + worker.TIED
    graph, plan = run.graphs[variant], run.plans[(variant, 2)]
    assert graph.metadata["tied_parameters"], f"{name}: the tracer recorded no tie"
    stage_of = plan.stage_of
    assert any(len({stage_of[n] for n, _ in tie.users}) > 1 for tie in find_ties(graph)), f"{name}: no tie is split"
    _check(run, variant, 2)
