"""The graph as the optimizer sees it (`Workload`: PipeDream's pre-processing) and bitset helpers.

Node sets are Python ints used as bitsets over node positions: union and intersection run at C speed.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph


@dataclass(frozen=True)
class Workload:
    """The graph after PipeDream's pre-processing: `Input*` sources and `__getitem__` sinks set aside.

    `node_ids` are the remaining nodes in file order (PipeDream's order); `inputs` and `dropped` are
    re-attached by the plan builder (inputs to stage 0, dropped sinks to their producer's stage).
    """

    node_ids: tuple[str, ...]
    compute_s: tuple[float, ...]  # (forward + backward) / 1000 per node
    activation: tuple[float, ...]
    parameters: tuple[float, ...]
    succ: tuple[tuple[int, ...], ...]  # direct successors, edge order
    pred: tuple[tuple[int, ...], ...]  # direct predecessors, edge order
    inputs: tuple[str, ...]
    dropped: tuple[str, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)


def preprocess(graph: Graph) -> Workload:
    """Drop `Input*` sources and `__getitem__` sinks exactly as PipeDream does (FORMATS.md step 1)."""
    inputs = tuple(n for n in graph.sources if graph[n].is_input)
    input_set = set(inputs)
    # PipeDream removes sinks after removing the inputs; an input is never a __getitem__ sink.
    remaining = [n for n in graph.nodes if n.node_id not in input_set]
    kept_edges = [(a, b) for a, b in graph.edges if a not in input_set and b not in input_set]
    has_out = {a for a, _ in kept_edges}
    dropped = tuple(n.node_id for n in remaining if n.node_id not in has_out and n.description.startswith("__getitem__"))
    dropped_set = set(dropped)
    remaining = [n for n in remaining if n.node_id not in dropped_set]
    if not remaining:
        raise PlanError("graph has no nodes left to partition after setting aside Input* sources and __getitem__ sinks")
    index = {n.node_id: i for i, n in enumerate(remaining)}
    succ: list[list[int]] = [[] for _ in remaining]
    pred: list[list[int]] = [[] for _ in remaining]
    for a, b in kept_edges:
        if a in index and b in index:
            succ[index[a]].append(index[b])
            pred[index[b]].append(index[a])
    return Workload(
        node_ids=tuple(n.node_id for n in remaining),
        compute_s=tuple((n.forward_ms + n.backward_ms) / 1000.0 for n in remaining),
        activation=tuple(n.activation_bytes for n in remaining),
        parameters=tuple(float(n.parameter_size) for n in remaining),
        succ=tuple(tuple(s) for s in succ),
        pred=tuple(tuple(p) for p in pred),
        inputs=inputs,
        dropped=dropped,
    )


def bit_positions(mask: int) -> list[int]:
    """Positions of the set bits of `mask`, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def masks_to_matrix(masks: list[int], n: int) -> np.ndarray:
    """Bitsets -> boolean matrix, row i = bits of masks[i] (bit v at column v)."""
    width = (n + 7) // 8
    raw = b"".join(m.to_bytes(width, "little") for m in masks)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8).reshape(len(masks), width), axis=1, bitorder="little")
    return bits[:, :n].astype(bool)


def matrix_to_masks(matrix: np.ndarray) -> list[int]:
    packed = np.packbits(matrix, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def closures(work: Workload) -> tuple[list[int], list[int]]:
    """Transitive ancestor and descendant bitsets (not including the node itself)."""
    n = work.num_nodes
    order = topological_order(work)
    anc = [0] * n
    for v in order:
        mask = 0
        for p in work.pred[v]:
            mask |= anc[p] | (1 << p)
        anc[v] = mask
    desc = [0] * n
    for v in reversed(order):
        mask = 0
        for s in work.succ[v]:
            mask |= desc[s] | (1 << s)
        desc[v] = mask
    return anc, desc


def topological_order(work: Workload) -> list[int]:
    """Kahn's algorithm, ties by node position (the Graph's own convention)."""
    indegree = [len(p) for p in work.pred]
    ready = [v for v in range(work.num_nodes) if indegree[v] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        v = heapq.heappop(ready)
        order.append(v)
        for s in work.succ[v]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, s)
    return order


def crossing_bytes(work: Workload, mask: int) -> float:
    """Bytes of the nodes in `mask` consumed by a node outside it: what really crosses that cut."""
    total = 0.0
    for v in bit_positions(mask):
        if any(not (mask >> s) & 1 for s in work.succ[v]):
            total += work.activation[v]
    return total

