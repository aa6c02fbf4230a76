"""The graph as the optimizer sees it (`Workload`: PipeDream's pre-processing) and bitset helpers.

Node sets are Python ints used as bitsets over node positions: union and intersection run at C speed.

Two facts of the graph restrict where a cut may go (`glued_groups`); every state space honours them:
- a node whose value cannot cross a stage boundary (`Node.uncrossable`) is in the same cuts as all its
  consumers (and the nodes between them): a cut after it would need the runtime to send its value;
- a side effect no model output depends on (torch.export's `num_batches_tracked.add_(1)`, one per
  BatchNorm, with no edge to the rest) travels with the node just before it in file order, where the
  profiler places it (right after its module's operator, `profiler/export_trace.py`). Left free, each
  such component doubles the cuts (2^49 for timm's efficientnet_b0) for a scalar add.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from model_parallel.errors import PlanError
from model_parallel.graph.arguments import referenced_nodes
from model_parallel.graph.core import Graph
from model_parallel.graph.precision import precision_of, wire_bytes


@dataclass(frozen=True)
class Workload:
    """The graph after PipeDream's pre-processing: `Input*` sources and `__getitem__` sinks set aside.

    `node_ids` are the remaining nodes in file order (PipeDream's order); `inputs` and `dropped` are
    re-attached by the plan builder (inputs to stage 0, dropped sinks to their producer's stage).

    A node's bytes count twice, differently: `activation` is what a stage holding it keeps for
    backward (the memory sums: its output bytes, or its profiled `stash_bytes` under the footprint
    memory model) and `wire` is what crosses a cut after it (its output bytes at the graph's precision:
    a float32 output crosses as bf16 under a bf16 profile, `graph.precision.wire_bytes`).
    """

    node_ids: tuple[str, ...]
    compute_s: tuple[float, ...]  # (forward + backward) / 1000 per node
    activation: tuple[float, ...]  # bytes held per node: the memory sums
    wire: tuple[float, ...]  # bytes sent per node when it is read across a cut
    parameters: tuple[float, ...]
    succ: tuple[tuple[int, ...], ...]  # direct successors, edge order
    pred: tuple[tuple[int, ...], ...]  # direct predecessors, edge order
    inputs: tuple[str, ...]
    dropped: tuple[str, ...]
    uncrossable: tuple[int, ...] = ()  # nodes whose value cannot leave their stage
    attached: tuple[tuple[int, int], ...] = ()  # (side-effect node, the node it travels with)

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)


def weight_gradient_node_bytes(graph: Graph) -> dict[str, float]:
    """Per node that uses a weight, the gradient a zero-bubble I keeps there for its W
    (runtime/step/backward_split.py): the size of the node's output."""
    out: dict[str, float] = {}
    for node in graph.nodes:
        if not node.reads_state and (node.parameter_size > 0 or
                                     any(graph[p].reads_state for p in graph.predecessors[node.node_id])):
            out[node.node_id] = node.activation_bytes
    return out


def preprocess(graph: Graph, memory_model: str = "pipedream", zero_bubble: bool = False) -> Workload:
    """Drop `Input*` sources and `__getitem__` sinks exactly as PipeDream does (FORMATS.md step 1).

    `memory_model` (`PartitionOptions.memory_model`) picks the held bytes: the legacy models keep
    PipeDream's output bytes (its reference partitions stay exact); "footprint" holds what autograd
    saves, `Node.stash_bytes`, and under a zero-bubble schedule (`zero_bubble`) the gradients kept for W."""
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
    precision = precision_of(graph)
    kept = weight_gradient_node_bytes(graph) if zero_bubble and memory_model == "footprint" else {}
    succ: list[list[int]] = [[] for _ in remaining]
    pred: list[list[int]] = [[] for _ in remaining]
    for a, b in kept_edges:
        if a in index and b in index:
            succ[index[a]].append(index[b])
            pred[index[b]].append(index[a])
    return Workload(
        node_ids=tuple(n.node_id for n in remaining),
        compute_s=tuple((n.forward_ms + n.backward_ms) / 1000.0 for n in remaining),
        activation=tuple(n.stash_bytes + kept.get(n.node_id, 0.0) if memory_model == "footprint" else n.activation_bytes
                         for n in remaining),
        wire=tuple(wire_bytes(n, precision) for n in remaining),
        parameters=tuple(float(n.parameter_size) for n in remaining),
        succ=tuple(tuple(s) for s in succ),
        pred=tuple(tuple(p) for p in pred),
        inputs=inputs,
        dropped=dropped,
        uncrossable=tuple(i for i, n in enumerate(remaining) if not n.crossable),
        attached=_side_effects(graph, input_set, index),
    )


def _side_effects(graph: Graph, inputs: set[str], index: dict[str, int]) -> tuple[tuple[int, int], ...]:
    """(node, anchor) for every workload node of a component (edges either way, model inputs aside) that
    holds no model output: its results feed nothing the model returns, only buffers it updates in place.
    The anchor is the workload node just before the component's first node in file order (else just after)."""
    encoded = graph.metadata.get("outputs")
    outputs = set(referenced_nodes(encoded)) if encoded is not None else set(graph.sinks)
    neighbours: dict[str, list[str]] = {n.node_id: [] for n in graph.nodes if n.node_id not in inputs}
    for a, b in graph.edges:
        if a not in inputs and b not in inputs:
            neighbours[a].append(b)
            neighbours[b].append(a)
    component: dict[str, int] = {}
    members: list[list[str]] = []
    for start in neighbours:
        if start in component:
            continue
        component[start] = len(members)
        todo, found = [start], [start]
        while todo:
            for other in neighbours[todo.pop()]:
                if other not in component:
                    component[other] = len(members)
                    todo.append(other)
                    found.append(other)
        members.append(found)
    if len(members) < 2:
        return ()
    order = list(index)  # workload nodes in file order
    attached = []
    for number, found in enumerate(members):
        if any(node in outputs for node in found):
            continue
        own = sorted(index[node] for node in found if node in index)
        if not own or len(own) == len(order):
            continue
        before = [v for v in range(own[0] - 1, -1, -1) if component[order[v]] != number]
        after = [v for v in range(own[0] + 1, len(order)) if component[order[v]] != number]
        anchor = (before or after)[0]
        attached += [(v, anchor) for v in own]
    return tuple(attached)


def glued_groups(work: Workload) -> list[int]:
    """Per node, the representative of the nodes that must be in exactly the same cuts (`v` itself when
    nothing binds it): an uncrossable node with its consumers, a side effect with its anchor, and every
    node on a path between two members (a cut holding the first must hold the last, hence all between)."""
    n = work.num_nodes
    parent = list(range(n))

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def union(a: int, b: int) -> None:
        a, b = find(a), find(b)
        if a != b:
            parent[max(a, b)] = min(a, b)

    for u in work.uncrossable:
        for s in work.succ[u]:
            union(u, s)
    for v, anchor in work.attached:
        union(v, anchor)
    if not work.uncrossable and not work.attached:
        return parent
    anc, desc = closures(work)
    changed = True
    while changed:  # close each group under "between two members" until nothing joins
        changed = False
        groups: dict[int, int] = {}
        for v in range(n):
            groups[find(v)] = groups.get(find(v), 0) | 1 << v
        for rep, mask in groups.items():
            if mask & (mask - 1) == 0:
                continue
            below = above = 0
            for v in bit_positions(mask):
                below |= anc[v]
                above |= desc[v]
            for v in bit_positions(below & above & ~mask):
                union(rep, v)
                changed = True
    return [find(v) for v in range(n)]


def glue_masks(work: Workload) -> list[int]:
    """The groups of `glued_groups` with more than one node, as bitsets."""
    groups: dict[int, int] = {}
    for v, rep in enumerate(glued_groups(work)):
        groups[rep] = groups.get(rep, 0) | 1 << v
    return [mask for mask in groups.values() if mask & (mask - 1)]


def respects_glue(masks: list[int], cut: int) -> bool:
    """Whether the cut (a bitset) holds each glued group whole or not at all."""
    return all(cut & mask in (0, mask) for mask in masks)


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
            total += work.wire[v]
    return total

