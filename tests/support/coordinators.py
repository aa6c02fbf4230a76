"""A chain graph, its two-stage plan and a live coordinator on localhost: what the coordinator tests share."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from model_parallel.coordinator.server import Coordinator
from model_parallel.coordinator.solver import default_solver
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan


def chain_graph(n: int = 4) -> Graph:
    """input0 -> n0 -> ... -> n{n-1}, each 0.5 ms forward and backward."""
    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=0.5, backward_ms=0.5) for i in range(n)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def two_stage_plan(graph: Graph, first: Optional[int] = None) -> Plan:
    """The first `first` nodes (default: half, the input counted) on rank 0, the rest on rank 1."""
    ids = list(graph.topological_order)
    half = first if first is not None else 1 + (len(ids) - 1) // 2
    return Plan((StagePlan(0, tuple(ids[:half]), ranks=(0,)), StagePlan(1, tuple(ids[half:]), ranks=(1,))))


@contextmanager
def live_coordinator(token: bytes, graph: Optional[Graph] = None, plan: Optional[Plan] = None,
                     **options: Any) -> Iterator[Coordinator]:
    """A Coordinator serving on 127.0.0.1 (any free port; `.address` says which), stopped on exit."""
    graph = graph if graph is not None else chain_graph()
    options.setdefault("solver", default_solver)
    coordinator = Coordinator(graph, plan if plan is not None else two_stage_plan(graph), token, **options)
    coordinator.address = f"127.0.0.1:{coordinator.start('127.0.0.1', 0)}"  # type: ignore[attr-defined]
    try:
        yield coordinator
    finally:
        coordinator.stop()
