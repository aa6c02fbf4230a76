"""Traced graphs: several sources, shape reads beside the main branch, a weight read per weight.

The antichain walk starts from a root before every source and folds free nodes and weight reads into
the nodes that decide them (`optimizer/antichains.py`); a plan marked exact must be exact, checked here
against brute force over every cut of small random graphs of that shape, and on timm's ViT and Mixer.
"""
from __future__ import annotations

import math
import random

import pytest

from model_parallel.graph.core import Graph, Node
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.antichains import antichain_states, enumerate_antichains, enumeration_view
from model_parallel.optimizer.brute_force import Cut, all_cuts, brute_force, chains_of
from model_parallel.optimizer.downset_count import count_downsets
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search import searched_partition as partition  # the search layers' entry
from model_parallel.optimizer.states import preprocess
from support.traced import traced_graph


def folded_cuts(work, cuts: list[Cut]) -> tuple[list[Cut], list[list[int]]]:
    """The cuts of `all_cuts` that keep every weight read with its reader, hold every free node whose
    inputs they hold and some node that is not free (the cut space the antichain walk covers), with
    strict inclusion between them."""
    def free(v: int) -> bool:
        return work.compute_s[v] == 0 and work.parameters[v] == 0 and work.activation[v] == 0

    def respects(mask: int) -> bool:
        if all(free(v) for v in range(work.num_nodes) if mask >> v & 1):
            return False  # free nodes alone: the empty cut, with what needs nothing added
        for v in range(work.num_nodes):
            inside = bool(mask >> v & 1)
            if free(v) and not inside and all(mask >> p & 1 for p in work.pred[v]):
                return False
            if not free(v) and not work.pred[v] and len(work.succ[v]) == 1 and work.compute_s[v] == 0:
                if inside != bool(mask >> work.succ[v][0] & 1):
                    return False
        return True

    kept = [c for c in cuts if respects(c.mask)]
    following = [[j for j, b in enumerate(kept) if b.mask != a.mask and a.mask & ~b.mask == 0] for a in kept]
    return kept, following


def _time(graph: Graph, machines: int, **options) -> tuple[float, bool]:
    plan = partition(graph, Hierarchy.from_lists([machines]), PartitionOptions(**options))
    assert set(plan.stage_of) == {n.node_id for n in graph.nodes}
    for src, dst in graph.edges:
        assert plan.stage_of[src] <= plan.stage_of[dst], (src, dst)
    return plan.time_per_minibatch_s, bool(plan.extra.get("exact"))


def _same(a: float, b: float) -> bool:
    return a == b == math.inf or math.isclose(a, b, rel_tol=1e-9)


def test_the_walk_meets_every_cut_of_the_folded_graph():
    for seed in range(60):
        graph = traced_graph(seed)
        work = preprocess(graph)
        found = enumerate_antichains(work)
        expected = {c.mask for c in folded_cuts(work, all_cuts(work)[0])[0]}
        assert set(found.downsets()) == expected, seed
        assert len(found) == len(expected), seed  # each once
        view = enumeration_view(work)
        assert count_downsets(view.work) - 1 - (view.root is not None) == len(found), seed


def test_count_downsets_counts_every_cut():
    for seed in range(60):
        work = preprocess(traced_graph(seed))
        assert count_downsets(work) == len(all_cuts(work)[0]) + 1, seed  # and the empty cut
    assert count_downsets(work, max_calls=1) is None


def test_exact_plans_equal_brute_force_over_every_cut():
    # No transfers counted and idle machines allowed: folding shape reads loses no plan, so the
    # antichain DP's optimum is the optimum over every cut of the graph.
    for seed in range(60):
        graph = traced_graph(seed, weights=False)
        work = preprocess(graph)
        machines = random.Random(seed).randint(1, 4)
        for cuts in ("antichain", "auto"):
            got, exact = _time(graph, machines, use_fewer_machines=True, cuts=cuts)
            oracle, _ = brute_force(*all_cuts(work), machines, 1e9, None, False, True)
            assert exact and _same(got, oracle), (seed, cuts, got, oracle)


@pytest.mark.slow
def test_exact_plans_with_weight_reads_equal_brute_force_over_the_cuts_that_keep_weights_with_readers():
    for seed in range(60):
        rng = random.Random(100 + seed)
        graph = traced_graph(seed)
        work = preprocess(graph)
        machines = rng.randint(1, 4)
        options = dict(straight_pipeline=rng.random() < 0.3, use_fewer_machines=rng.random() < 0.5)
        args = (machines, 1e9, None, options["straight_pipeline"], options["use_fewer_machines"])
        got, exact = _time(graph, machines, cuts="antichain", **options)
        oracle, _ = brute_force(*folded_cuts(work, all_cuts(work)[0]), *args)
        assert exact and _same(got, oracle), (seed, options, got, oracle)
        # With transfers counted the DP is optimal over its own states, and no plan beats every cut.
        got, _ = _time(graph, machines, cuts="antichain", activation_compression_ratio=1.0, **options)
        ratio_args = (machines, 1e9, 1.0, options["straight_pipeline"], options["use_fewer_machines"])
        own, _ = brute_force(*chains_of(antichain_states(work)), *ratio_args)
        everything, _ = brute_force(*all_cuts(work), *ratio_args)
        assert _same(got, own), (seed, got, own)
        assert got >= everything * (1 - 1e-12), (seed, got, everything)


def mixer_like() -> Graph:
    """timm's Mixer as fx records it: the input's shape is read (for an `_assert`) before anything else."""
    nodes = [Node("x", "Input0", activation_size=4.0), Node("size", "getattr('shape')"),
             Node("getitem", "__getitem__(2)"), Node("eq", "operator.eq(32)"), Node("assert", "torch._assert")]
    edges = [("x", "size"), ("size", "getitem"), ("getitem", "eq"), ("eq", "assert")]
    last = "x"
    for index in range(6):
        nodes.append(Node(f"block{index}", "Linear", 1.0, 2.0, 2.0**20, 2.0**18))
        edges.append((last, f"block{index}"))
        last = f"block{index}"
    return Graph(tuple(nodes), tuple(edges))


def test_a_shape_read_of_the_input_no_longer_gives_one_stage():
    # The walk started at the shape read, the first source, never cut the main branch, and returned
    # one stage of everything (0 ms: its last state was not the whole graph), marked exact.
    hierarchy = Hierarchy.from_lists([4])
    plan = partition(mixer_like(), hierarchy, PartitionOptions(activation_compression_ratio=1.0))
    every_cut = partition(mixer_like(), hierarchy, PartitionOptions(activation_compression_ratio=1.0, cuts="all"))
    assert len(plan.stages) == 2 and plan.extra["exact"] is True
    assert plan.time_per_minibatch_s == pytest.approx(every_cut.time_per_minibatch_s, rel=1e-12)
    assert plan.time_per_minibatch_s > 0.005


def _timm_graph(name: str) -> Graph:
    """The model's real traced graph (the structure under test: Mixer reads the input's shape first)
    with synthetic costs. Profiled times made the test a coin toss: one cold timing on a busy machine
    once priced Mixer's nodes so that one stage replicated 4x beat every pipeline (a CI emulation in a
    fresh clone), a valid plan for those numbers and not what this checks."""
    import torch

    import model_parallel  # noqa: F401  (repairs torchvision for timm)
    import timm

    from model_parallel.optimizer import synthetic
    from model_parallel.profiler.trace import trace_model

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=32, num_classes=10)
    graph, _ = trace_model(model, (torch.randn(2, 3, 32, 32),))
    return synthetic.traced_costs(graph)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "mixer_s16_224"])
def test_timm_models_get_real_pipelines(name):
    graph = _timm_graph(name)
    plan = partition(graph, Hierarchy.from_lists([4]), PartitionOptions(activation_compression_ratio=1.0))
    assert len(plan.stages) >= 2, plan.table()
    assert plan.extra["exact"] is True
    slowest = max(stage.compute_s for stage in plan.stages)
    total = sum(n.forward_ms + n.backward_ms for n in graph.nodes) / 1000
    assert slowest < total * 0.75, plan.table()  # not everything on one stage


def test_beyond_the_enumeration_limit_the_main_source_walk_gives_candidates_never_exact():
    from model_parallel.optimizer.tuning import Tuning

    checked = 0
    for seed in range(20):
        graph = traced_graph(seed)
        work = preprocess(graph)
        everything = set(enumerate_antichains(work).downsets())
        some = set(enumerate_antichains(work, main_source_only=True).downsets())
        assert some <= everything, seed  # real cuts, fewer of them
        if some == everything:
            continue
        hierarchy = Hierarchy.from_lists([3])
        limited = PartitionOptions(max_antichain_states=2, tuning=Tuning(enumeration_limit=len(everything) - 1))
        plan = partition(graph, hierarchy, limited)
        optimum = partition(graph, hierarchy, PartitionOptions())
        assert optimum.extra["exact"] is True and plan.extra["exact"] is False, seed
        assert plan.time_per_minibatch_s >= optimum.time_per_minibatch_s * (1 - 1e-12), seed
        assert 0 < plan.extra["lower_bound_s"] <= optimum.time_per_minibatch_s * (1 + 1e-12), seed
        checked += 1
    assert checked >= 5


from support import FIXTURES  # noqa: E402


def _insitu(name: str) -> Graph:
    from model_parallel.graph.io import load_graph

    # Written by tests/fixtures/make_real_profiles.py (tiny Hugging Face models of tests/support/hf_zoo.py,
    # profiled in situ on CPU): many small nodes and one noisy outlier, the regime that made the bounded
    # solve keep 47,190 cuts of BERT on 16 workers (48 s, most of it the states x states ancestor matrix).
    return load_graph(FIXTURES / f"{name}_insitu.graph.txt", use_sidecar=False)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.parametrize("levels", [[4], [4, 2], [8, 2], [4, 4]])
def test_in_situ_transformer_profiles_partition_into_a_valid_plan(name, levels):
    # How long it takes is bench/optimizer.py --zoo's to measure, not a test's (a loaded machine made a
    # 10 s assert here fail); here the plan covers the graph, keeps edges forward and respects its bound.
    graph = _insitu(name)
    plan = partition(graph, Hierarchy.from_lists(levels))
    assert set(plan.stage_of) == {n.node_id for n in graph.nodes}
    for src, dst in graph.edges:
        assert plan.stage_of[src] <= plan.stage_of[dst], (src, dst)
    if not plan.extra["exact"]:
        assert 0 < plan.extra["lower_bound_s"] <= plan.time_per_minibatch_s * (1 + 1e-12)


def test_bert_in_situ_on_16_workers_keeps_the_optimum_within_the_work_budget():
    # Unlimited, the bounded solve proves 0.9326 ms optimal (tens of seconds); with no budget below the best
    # time, the plan found must be that good or within its own lower bound, never claimed exact unproven.
    from model_parallel.optimizer.tuning import Tuning

    graph = _insitu("bert")
    plan = partition(graph, Hierarchy.from_lists([8, 2]))
    assert plan.time_per_minibatch_s <= 0.9327e-3 * 1.01, plan.time_per_minibatch_s
    capped = partition(graph, Hierarchy.from_lists([8, 2]), PartitionOptions(tuning=Tuning(below_budgets=(0.0,))))
    assert capped.extra["exact"] is False or capped.time_per_minibatch_s == pytest.approx(plan.time_per_minibatch_s)


def test_strict_inclusion_matches_the_matrix_product():
    import numpy as np

    from model_parallel.optimizer.states import node_kinds, strict_inclusion

    rng = np.random.default_rng(0)
    for trial in range(30):
        matrix = rng.random((int(rng.integers(1, 400)), int(rng.integers(1, 150)))) < rng.random()
        if trial % 2:  # size order, as cut_costs gives them: only the smaller columns are tested
            matrix = matrix[np.argsort(matrix.sum(axis=1), kind="stable")]
        if trial % 3 == 0 and len(matrix) > 2:
            matrix[1] = matrix[0]  # equal rows are inside each other
        kinds = node_kinds(matrix)
        expected = ((~kinds).astype(np.float32) @ kinds.astype(np.float32).T) == 0
        np.fill_diagonal(expected, False)
        assert np.array_equal(strict_inclusion(matrix, block=int(rng.integers(1, 64))), expected), trial
