"""The converter says plainly when it replaces the partitioner's plan (--stage_to_num_ranks asks another shape)."""
import logging

from model_parallel.cli.generate import straight_recut
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan


def test_a_recut_is_reported_as_what_was_done(caplog):
    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=0.5, backward_ms=0.5) for i in range(6)]
    graph = Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))
    ids = [n.node_id for n in nodes]
    two = Plan((StagePlan(0, tuple(ids[:4]), num_replicas=2, ranks=(0, 1)), StagePlan(1, tuple(ids[4:]), ranks=(2,))))
    with caplog.at_level(logging.WARNING):
        plan = straight_recut(graph, two, {0: 1, 1: 1, 2: 1}, "gpus=3.txt")
    assert plan.num_stages == 3
    assert "NOT using the 2-stage plan in gpus=3.txt" in caplog.text
    assert "re-cut the profile itself into a straight 3-stage pipeline" in caplog.text
    assert "--straight_pipeline -n 3" in caplog.text
