"""The footprint prices an offloaded optimizer state (runtime/step/offload.py) as its chunk, not k W: the split that
`memory_per_worker` finds uses the memory the offload frees (optimizer/memory.py, contiguous.py, assemble.py)."""
from __future__ import annotations

import pytest

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.optimizer.contiguous import even_stages
from model_parallel.optimizer.memory import Footprint, MemoryLimit, plan_footprint

W = 4_000_000.0  # bytes of each layer's weights
A = 1_000.0  # bytes each layer keeps for backward
CHUNK = 1_000_000.0


def chain(layers: int = 8) -> Graph:
    nodes = [Node("x", "Input0", activation_size=A)]
    nodes += [Node(f"l{i}", "linear", forward_ms=1.0, activation_size=A, saved_bytes=A, parameter_size=W)
              for i in range(layers)]
    edges = [(nodes[i].node_id, nodes[i + 1].node_id) for i in range(layers)]
    return Graph(nodes=tuple(nodes), edges=tuple(edges), metadata={"outputs": {"node": nodes[-1].node_id}})


def test_offloaded_state_is_priced_as_its_chunk():
    graph = chain()
    plan = even_stages(graph, 2)
    plain = plan_footprint(graph, plan, Footprint("adamw", "1f1b", 2))
    offloaded = plan_footprint(graph, plan, Footprint("adamw", "1f1b", 2, offload_chunk=CHUNK))
    for a, b in zip(plain, offloaded):
        assert a["optimizer_state"] == 2 * a["parameters"] == 2 * 4 * W
        assert b["optimizer_state"] == CHUNK
        assert a["total"] - b["total"] == 2 * 4 * W - CHUNK
    # A stage whose whole state is under the chunk holds all of it at once, no more.
    small = plan_footprint(graph, plan, Footprint("sgd_momentum", "1f1b", 2, offload_chunk=1e12))
    assert [p["optimizer_state"] for p in small] == [4 * W, 4 * W]
    with pytest.raises(PlanError, match="offload_chunk must be bytes > 0"):
        Footprint("adamw", offload_chunk=0.0)


def test_memory_per_worker_finds_the_split_the_offload_makes_room_for():
    graph = chain()
    plain, offloaded = Footprint("adamw", "1f1b", 2), Footprint("adamw", "1f1b", 2, offload_chunk=CHUNK)
    # Each rank holds 4 of the 8 layers: params + grads 8 W, AdamW 8 W more unless offloaded (then the chunk).
    cap = 4 * 2 * W + CHUNK + 3 * 4 * A  # under 4 layers' plain footprint (16 W)
    with pytest.raises(InfeasibleError, match="smallest that fits"):
        even_stages(graph, 2, memory_per_worker=cap, footprint=plain)
    plan = even_stages(graph, 2, memory_per_worker=cap, footprint=offloaded)
    parts = plan_footprint(graph, plan, offloaded)
    assert all(p["total"] <= cap for p in parts)
    assert [s.memory_bytes for s in plan.stages] == pytest.approx([p["total"] for p in parts], rel=1e-9)
    MemoryLimit(cap, offloaded).check(graph, plan)  # the runtime's check agrees with the search
    # The smallest that fits, named when the chunk does not: cap less one byte under the chunk-priced need.
    with pytest.raises(InfeasibleError, match="smallest that fits"):
        even_stages(graph, 2, memory_per_worker=4 * 2 * W, footprint=offloaded)
