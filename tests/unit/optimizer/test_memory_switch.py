"""A live switch holds the old and the new stage's layers on a rank until it commits (so it can be rolled back):
`MemoryLimit.check_switch` prices that moment, which can be over the limit while both plans fit (optimizer/memory.py)."""
from __future__ import annotations

import pytest

from model_parallel.errors import InfeasibleError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.optimizer.memory import Footprint, MemoryLimit

MB = 1e6


def chain(sizes_mb: list[float]) -> Graph:
    nodes = [Node("x", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=1.0, parameter_size=s * MB)
                                     for i, s in enumerate(sizes_mb)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def split(graph: Graph, at: int, version: int) -> Plan:
    ids = list(graph.topological_order)
    return Plan((StagePlan(0, tuple(ids[:at]), ranks=(0,)), StagePlan(1, tuple(ids[at:]), ranks=(1,))), version=version)


def limit(memory_mb: float, optimizer: str = "sgd_momentum") -> MemoryLimit:
    return MemoryLimit(memory_mb * MB, Footprint(optimizer, "1f1b", 2))


def test_a_switch_over_the_limit_while_both_plans_fit_is_refused_naming_the_rank_and_the_bytes() -> None:
    graph = chain([10, 10, 10, 10])
    old, new = split(graph, 4, 0), split(graph, 2, 1)  # rank 1 holds n3 (10 MB), then n1..n3 (30 MB)
    # Steady: rank 1's new stage is 30 MB x (parameter, gradient, momentum) = 90 MB (activations none).
    memory = limit(100)
    memory.check(graph, old)
    memory.check(graph, new)
    # The switch on rank 1: n1..n3 and their momentum (60 MB) + n1, n2 arriving with momentum in buffers (40 MB).
    with pytest.raises(InfeasibleError, match=r"the switch from plan v0 to v1 puts a predicted 0\.1 GB on rank 1 .*"
                                              r"old and new layers 0\.06 GB, arriving values in flight 0\.04 GB\), "
                                              r"over memory_per_worker 0\.0999 GB; switch in smaller moves"):
        limit(99.9).check_switch(graph, old, new)
    memory.check_switch(graph, old, new)  # exactly at the limit: allowed


def test_the_receiving_rank_is_named_whichever_way_layers_move_and_plain_sgd_holds_no_state() -> None:
    graph = chain([10, 10, 10, 10])
    back, there = split(graph, 2, 0), split(graph, 4, 1)  # rank 0 receives n1, n2; rank 1 keeps n3
    with pytest.raises(InfeasibleError, match=r"on rank 0 .*old and new layers 0\.06 GB, arriving values in flight 0\.04 GB"):
        limit(99.9).check_switch(graph, back, there)
    limit(50, "sgd").check_switch(graph, back, there)  # plain SGD: 30 MB held + 20 MB arriving
    with pytest.raises(InfeasibleError, match="on rank 0 "):
        limit(49.9, "sgd").check_switch(graph, back, there)
