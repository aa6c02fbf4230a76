"""The optimizer's core without its optional parts: no numba, no search; and the one contiguous partitioner."""
from __future__ import annotations


import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.io import load_graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.contiguous import even_stages, straight_plan
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.runtime.build.stages import even_plan


def test_default_plan_of_vgg16_is_balanced(reference_profiles):
    # The runtime's default plan (no plan given) was 680 / 0 / 7 / 3 ms here: it mixed bytes into the
    # node costs. Priced by time, its slowest stage is within 1.5x of the optimizer's balanced plan.
    graph = load_graph(reference_profiles / "vgg16.graph.txt")
    default = even_plan(graph, 4)
    balanced = partition(graph, Hierarchy.from_lists([4]), PartitionOptions(straight_pipeline=True))
    slowest = max(stage.compute_s for stage in default.stages)
    assert min(stage.compute_s for stage in default.stages) > 0
    assert slowest <= 1.5 * balanced.time_per_minibatch_s
    order = list(graph.topological_order)
    assert [n for stage in default.stages for n in stage.node_ids] == order  # contiguous, in order


def test_straight_plan_puts_stage_k_on_rank_k_and_checks_its_arguments():
    graph = synthetic.chain(6)
    plan = straight_plan(graph, [5, 3], [1.0, 2.0])
    assert [s.ranks for s in plan.stages] == [(5,), (3,)]
    assert plan.stages[0].compute_s <= plan.stages[1].compute_s  # the faster worker takes more
    with pytest.raises(PlanError, match="got 1 speed\\(s\\) for 2 worker"):
        straight_plan(graph, [0, 1], [1.0])
    with pytest.raises(PlanError, match="into 9 stage"):
        straight_plan(graph, range(9))


def test_a_graph_without_timings_or_parameters_splits_evenly_by_node_count():
    # (With parameters, an untimed graph splits by their bytes: tests/integration/test_default_split.py.)
    graph = synthetic.chain(8)
    untimed = type(graph)(tuple(node.__class__(**{**node.__dict__, "forward_ms": 0.0, "backward_ms": 0.0,
                                                   "parameter_size": 0.0}) for node in graph.nodes), graph.edges)
    plan = even_stages(untimed, 4, {1: 2})
    assert [len([n for n in s.node_ids if not untimed[n].is_input]) for s in plan.stages] == [2, 2, 2, 2]
    assert [s.ranks for s in plan.stages] == [(0,), (1, 2), (3,), (4,)]
