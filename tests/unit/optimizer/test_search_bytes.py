"""The search weighs a node's bytes two ways (`Workload.activation` held, `Workload.wire` sent): a bf16
profile's float32 cuts cost what they send (bf16), and the footprint's memory limit counts what
autograd saves (`Node.stash_bytes`), not every output."""
from __future__ import annotations

import math

import pytest

from model_parallel.errors import InfeasibleError
from model_parallel.graph.core import Graph, LayerSpec, Node, TensorMeta
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.brute_force import all_cuts, brute_force
from model_parallel.optimizer.costs import predict_stage_times, stage_costs
from model_parallel.optimizer.memory import Footprint
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.states import preprocess

BANDWIDTH = 1e6  # slow enough that the transfers, not the 1 ms of compute per node, decide the cut


def _node(node_id: str, dtype: str, numel: int, size: float, saved: float | None = None) -> Node:
    return Node(node_id, node_id, forward_ms=1.0, activation_size=size, saved_bytes=saved,
                layer=LayerSpec("call_function", "f", outputs=(TensorMeta((numel,), dtype),)))


def _wire_chain(precision: str) -> Graph:
    """x -> a (float32, 4096 B) -> b (bfloat16, 3000 B) -> c (int64, 8000 B) -> d. At fp32 the cheapest cut
    is after b (3000 < 4096 bytes); at bf16 a's float32 output crosses as 2048 bytes: after a."""
    nodes = (Node("x", "Input0", activation_size=64.0), _node("a", "float32", 1024, 4096.0),
             _node("b", "bfloat16", 1500, 3000.0), _node("c", "int64", 1000, 8000.0), _node("d", "float32", 1, 4.0))
    edges = (("x", "a"), ("a", "b"), ("b", "c"), ("c", "d"))
    return Graph(nodes, edges, {"profile": {"precision": precision, "clock": "wall"}})


def test_the_workload_sends_wire_bytes_and_holds_output_bytes() -> None:
    fp32, bf16 = preprocess(_wire_chain("fp32")), preprocess(_wire_chain("bf16"))
    assert fp32.wire == fp32.activation == (4096.0, 3000.0, 8000.0, 4.0)  # fp32: one array, bit for bit
    assert bf16.activation == fp32.activation and bf16.wire == (2048.0, 3000.0, 8000.0, 2.0)


@pytest.mark.parametrize("cuts", ["auto", "antichain", "topological", "all"])
def test_a_bf16_search_picks_the_cut_that_sends_fewest_bf16_bytes(cuts: str) -> None:
    hierarchy = Hierarchy.from_lists([2], [BANDWIDTH])
    options = PartitionOptions(straight_pipeline=True, activation_compression_ratio=1.0, cuts=cuts)
    fp32 = partition(_wire_chain("fp32"), hierarchy, options)
    assert fp32.stages[0].node_ids == ("x", "a", "b")  # 3000 bytes cross
    graph = _wire_chain("bf16")
    bf16 = partition(graph, hierarchy, options)
    assert bf16.stages[0].node_ids == ("x", "a")  # a's 4096 float32 bytes cross as 2048
    assert bf16.time_per_minibatch_s == pytest.approx(2 * 2048 / BANDWIDTH)
    # The search's number is the cost model's price of the plan it chose, at the graph's precision.
    priced = predict_stage_times(graph, bf16, bandwidth=BANDWIDTH, activation_compression_ratio=1.0)
    assert bf16.time_per_minibatch_s == pytest.approx(max(priced), rel=1e-12)
    stage_of = {n: s.stage_id for s in bf16.stages for n in s.node_ids}
    assert stage_costs(graph, stage_of, 2)[0].output_bytes == 2048.0
    oracle, _ = brute_force(*all_cuts(preprocess(graph)), 2, BANDWIDTH, 1.0, True)
    assert bf16.time_per_minibatch_s == pytest.approx(oracle, rel=1e-12)


def _saving_chain() -> Graph:
    """Four nodes of 1000 output bytes each that autograd saves only 100 bytes of (a ReLU's mask, say)."""
    nodes = (Node("x", "Input0", activation_size=0.0),
             *(_node(name, "float32", 250, 1000.0, saved=100.0) for name in "abcd"))
    edges = (("x", "a"), ("a", "b"), ("b", "c"), ("c", "d"))
    return Graph(nodes, edges, {"profile": {"precision": "fp32", "clock": "wall"}})


@pytest.mark.parametrize("cuts", ["auto", "antichain", "topological", "all"])
def test_a_footprint_limit_counts_saved_bytes_not_outputs(cuts: str) -> None:
    # GPipe with one microbatch holds one microbatch's stash; no parameters: a stage's bytes are its stash.
    footprint = Footprint("sgd", "gpipe", microbatches=1)
    limit = 1500.0  # two outputs per stage (2000 bytes) do not fit; two saved (200) plus a crossing value do
    hierarchy = Hierarchy.from_lists([2], [1e9], limit)
    options = PartitionOptions(straight_pipeline=True, use_memory_constraint=True, memory_model="footprint",
                               footprint=footprint, cuts=cuts)
    graph = _saving_chain()
    plan = partition(graph, hierarchy, options)
    assert plan.num_stages == 2 and max(s.memory_bytes for s in plan.stages) <= limit
    work = preprocess(graph, "footprint")
    assert work.activation == (100.0,) * 4 and work.wire == (1000.0,) * 4
    oracle, _ = brute_force(*all_cuts(work), 2, 1e9, None, True, False, limit, footprint)
    assert math.isfinite(oracle) and plan.time_per_minibatch_s == pytest.approx(oracle, rel=1e-12)
    # Summing output bytes (the legacy weighing) refuses every two-stage split under this limit.
    legacy, _ = brute_force(*all_cuts(preprocess(graph)), 2, 1e9, None, True, False, limit, footprint)
    assert legacy == math.inf


def test_the_legacy_memory_models_still_sum_output_bytes() -> None:
    graph = _saving_chain()
    assert preprocess(graph, "pipedream").activation == preprocess(graph, "1f1b").activation == (1000.0,) * 4
    options = PartitionOptions(straight_pipeline=True, use_memory_constraint=True, memory_model="1f1b")
    with pytest.raises(InfeasibleError):  # 1f1b on 2 ranks: stage 0 holds 2 x its 2000 output bytes
        partition(graph, Hierarchy.from_lists([2], [1e9], 1500.0), options)
