"""Values that cannot cross a stage boundary, and side effects with no edge to the rest of the graph.

The profiler records on each node whether its value can be sent to another stage (`Node.uncrossable`:
a Python object the wire cannot carry, a buffer its reader updates in place); graph.json keeps it; every
optimizer (the hierarchical one over each cut space, the contiguous one the rebalancer calls) keeps such
a node with its consumers; a plan given by hand that cuts after one is refused before any step, naming
it. torch.export's BatchNorm counter updates (`num_batches_tracked.add_(1)`, no edge to the rest) travel
with their BatchNorm, so timm's efficientnet_b0 gets exact plans (it had 2^49 cuts).
"""
from __future__ import annotations

import collections
import json

import pytest
import torch
from torch import nn

from model_parallel.codegen.boundary import stage_boundaries
from model_parallel.coordinator.solver import default_solver
from model_parallel.errors import GraphError, PlanError
from model_parallel.graph.arguments import OutputDict
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.crossing import value_refusal
from model_parallel.graph.io import load_graph, save_graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import plan_from_graph, read_plan, write_plan
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.antichains import enumerate_antichains
from model_parallel.optimizer.contiguous import straight_plan
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.workload import glued_groups, preprocess
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.wire.structure import flatten

REASON = "the value is a Box, which the wire format cannot carry"


def chain(uncrossable: bool) -> Graph:
    """a -> b -> c -> d -> e, 1 ms each, plus b -> d: on 2 stages the best cut is right after b (2|3 ms,
    where a cut after c sends b's value on too); b uncrossable forbids it, and the cut after c with it."""
    nodes = [Node("in", "Input0")]
    for name in "abcde":
        nodes.append(Node(name, f"Op{name}", forward_ms=0.5, backward_ms=0.5, activation_size=4.0,
                          uncrossable=REASON if uncrossable and name == "b" else None))
    edges = [("in", "a"), ("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("b", "d")]
    return Graph(tuple(nodes), tuple(edges), {"outputs": {"node": "e"}})


def stage_of(plan) -> dict[str, int]:
    return {n: s.stage_id for s in plan.stages for n in s.node_ids}


@pytest.mark.parametrize("cuts", ["auto", "antichain", "topological", "all"])
def test_the_hierarchical_optimizer_never_cuts_after_an_uncrossable_node(cuts: str) -> None:
    options = PartitionOptions(straight_pipeline=True, cuts=cuts)
    free = stage_of(partition(chain(False), Hierarchy.from_lists([2]), options))
    assert free["b"] != free["c"], "the unconstrained best cut should be right after b"
    plan = partition(chain(True), Hierarchy.from_lists([2]), options)
    placed = stage_of(plan)
    assert placed["b"] == placed["c"] == placed["d"] and plan.num_stages == 2
    stage_boundaries(chain(True), placed)  # the runtime can run it


def test_the_contiguous_partitioner_and_the_rebalancer_keep_consumers_with_an_uncrossable_node() -> None:
    assert stage_of(straight_plan(chain(False), [0, 1]))["b"] != stage_of(straight_plan(chain(False), [0, 1]))["c"]
    for plan in (straight_plan(chain(True), [0, 1]), default_solver(chain(True), [3, 5], [1.0, 1.0]),
                 default_solver(chain(True), [3, 5], [1.0, 4.0])):
        placed = stage_of(plan)
        assert placed["b"] == placed["c"] == placed["d"] and plan.num_stages == 2
    assert [s.ranks for s in default_solver(chain(True), [3, 5], [1.0, 1.0]).stages] == [(3,), (5,)]


def test_a_plan_given_by_hand_that_cuts_after_an_uncrossable_node_is_refused_naming_it(tmp_path) -> None:
    graph = chain(True)
    cut = {"in": 0, "a": 0, "b": 0, "c": 1, "d": 1, "e": 1}
    write_plan(plan_from_graph(graph.with_stages(cut)), tmp_path / "plan.json")
    plan = read_plan(tmp_path / "plan.json")
    with pytest.raises(PlanError, match=r"node b's value from stage 0 to stage 1.*Box.*put b and its consumers \(c, d\)"):
        stage_boundaries(graph, plan.stage_of)
    stage_boundaries(chain(False), plan.stage_of)  # the same cut of a crossable b runs


def test_graph_json_keeps_the_reason_and_older_files_read_as_crossable(tmp_path) -> None:
    save_graph(chain(True), tmp_path / "graph.json")
    assert load_graph(tmp_path / "graph.json")["b"].uncrossable == REASON
    save_graph(chain(True), tmp_path / "graph.txt")  # PipeDream's text has no field: the sidecar keeps it
    assert load_graph(tmp_path / "graph.txt")["b"].uncrossable == REASON
    data = json.loads((tmp_path / "graph.json").read_text())
    assert [e for e in data["nodes"] if "uncrossable" in e] == [e for e in data["nodes"] if e["id"] == "b"]
    for entry in data["nodes"]:
        entry.pop("uncrossable", None)
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert all(n.crossable for n in load_graph(tmp_path / "old.json").nodes)
    with pytest.raises(GraphError, match="node b: uncrossable must be a reason"):
        Node("b", "Op", uncrossable="")


class Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Pack(nn.Module):
    def forward(self, x: torch.Tensor) -> Box:
        return Box(x * 2)


class Unpack(nn.Module):
    def forward(self, box: Box) -> torch.Tensor:
        return box.value + 1


class Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.pack, self.unpack = Pack(), Unpack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[1](self.layers[0](x))
        return self.layers[3](self.layers[2](self.unpack(self.pack(x))))


def test_the_profiler_records_a_value_the_wire_cannot_carry_and_plans_keep_it_in_one_stage() -> None:
    graph, _ = trace_model(Boxed(), (torch.randn(4, 16),), leaf_modules=[Pack, Unpack])
    assert "test_uncrossable.Box" in graph["pack"].uncrossable
    assert [n.node_id for n in graph.nodes if not n.crossable] == ["pack"]
    timed = synthetic.traced_costs(graph)
    for plan in (partition(timed, Hierarchy.from_lists([4]), PartitionOptions(straight_pipeline=True)),
                 straight_plan(timed, range(4))):
        placed = stage_of(plan)
        assert placed["pack"] == placed["unpack"] and plan.num_stages == 4
        stage_boundaries(timed, placed)


def test_what_the_profiler_calls_crossable_is_what_the_wire_carries() -> None:
    values = [torch.ones(2), (torch.ones(1), 3), [None, 1.5, float("inf"), "s"], {"a": torch.ones(1), 2: True},
              OutputDict(logits=torch.ones(1)), collections.namedtuple("P", "x y")(1, torch.ones(1)),
              torch.max(torch.ones(2, 2), 1), torch.Size([2]), torch.float16, torch.device("cpu"),
              Box(torch.ones(1)), {(1, 2): torch.ones(1)}, [1, {"deep": object()}], slice(0, 2), {1.5: 0}]
    for value in values:
        try:
            flatten(value)
            carried = True
        except PlanError:
            carried = False
        assert (value_refusal(value) is None) == carried, value


class BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                                  nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).mean((2, 3))


def test_export_keeps_a_batchnorm_counter_update_with_its_batchnorm_and_marks_the_buffers_it_updates() -> None:
    graph, _ = trace_model(BatchNormed(), (torch.randn(2, 3, 12, 12),), route="export")
    order = [n.node_id for n in graph.nodes]
    updates = [n for n in graph.nodes if n.layer.target == "torch.ops.aten.add_.Tensor"]
    assert len(updates) == 3
    for update in updates:
        (read,) = graph.predecessors[update.node_id]
        assert graph[read].layer.target.endswith("num_batches_tracked") and "updated in place" in graph[read].uncrossable
        # Right after its module's batch_norm (export recorded it before the module's other reads).
        assert graph[order[order.index(read) - 1]].layer.target == "torch.ops.aten.batch_norm.default"
    statistics = [n for n in graph.nodes if n.layer.target.endswith(("running_mean", "running_var"))]
    assert len(statistics) == 6 and all("batch_norm" in n.uncrossable for n in statistics)
    timed = synthetic.traced_costs(graph)
    work = preprocess(timed)
    assert len(work.attached) == 6  # each counter read and update, attached to its batch_norm
    # The side effects add no cuts: the same antichain states as the graph without them.
    without = {n.node_id for n in updates} | {graph.predecessors[n.node_id][0] for n in updates}
    pruned = Graph(tuple(n for n in timed.nodes if n.node_id not in without),
                   tuple(e for e in timed.edges if not set(e) & without), timed.metadata)
    assert len(enumerate_antichains(work)) == len(enumerate_antichains(preprocess(pruned)))
    plan = partition(timed, Hierarchy.from_lists([3]), PartitionOptions(straight_pipeline=True))
    assert plan.extra["exact"] and plan.extra["cuts"] == "antichain"
    placed = stage_of(plan)
    for update in updates:
        batch_norm = order[order.index(update.node_id) - 2]
        assert placed[update.node_id] == placed[batch_norm]
    stage_boundaries(timed, placed)


def test_a_side_effect_component_travels_with_the_node_before_it_and_the_cuts_do_not_double() -> None:
    nodes = [Node("in", "Input0")] + [Node(f"n{i}", "Op", forward_ms=1.0, activation_size=4.0) for i in range(6)]
    counters = []
    for i in (1, 3):  # a counter read and update after n1 and after n3, with no edge to the rest
        counters += [Node(f"read{i}", "Attribute(c)", activation_size=8.0), Node(f"bump{i}", "add_", forward_ms=0.01)]
        nodes.insert([n.node_id for n in nodes].index(f"n{i}") + 1, counters[-1])
        nodes.insert([n.node_id for n in nodes].index(f"n{i}") + 1, counters[-2])
    edges = [("in", "n0")] + [(f"n{i}", f"n{i + 1}") for i in range(5)] + [("read1", "bump1"), ("read3", "bump3")]
    graph = Graph(tuple(nodes), tuple(edges), {"outputs": {"node": "n5"}})
    work = preprocess(graph)
    ids = work.node_ids
    assert {(ids[v], ids[a]) for v, a in work.attached} == {("read1", "n1"), ("bump1", "n1"), ("read3", "n3"), ("bump3", "n3")}
    rep = glued_groups(work)
    assert rep[ids.index("bump3")] == rep[ids.index("n3")] != rep[ids.index("n4")]
    assert len(enumerate_antichains(work)) == 6  # the chain's 6 cuts, not 6 * 2 * 2
    # Without the outputs record every sink counts as a model output (PipeDream's graphs): nothing attached.
    assert preprocess(Graph(graph.nodes, graph.edges)).attached == ()
