"""Optimizer states: the cut points a partition may use, with cumulative costs (PipeDream's antichains or topological prefixes).

A state s stands for a downward-closed set of nodes `P(s)` (everything computed before the cut).
The DP in `dp.py` only needs, per state, the cumulative compute/activation/parameter sums over `P(s)`,
the bytes crossing the cut `O(s)`, and which states are ancestors of which. Two state spaces:

- `antichain_states`: PipeDream's antichain DAG, reproduced one for one (same enumeration, same
  augmentation, same depth-first topological order), so the DP gives PipeDream's numbers.
- `prefix_states`: the prefixes of one topological order of the nodes (n states, totally ordered).
  Cheap for any graph; every cut is valid; used by the straight-pipeline fast path and big graphs.

Node sets are Python ints used as bitsets over node positions: union/intersection are C-speed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from model_parallel.errors import InfeasibleError, PlanError
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


@dataclass(frozen=True)
class States:
    """Cut states in a topological order of the state DAG (the last state covers every node).

    `members[s]` is the bitset `P(s)`; `compute/activation/parameters[s]` the sums over it;
    `output[s]` = `O(s)`; `pred_mask[j, k]` is True when state k is a (transitive) ancestor of j.
    """

    members: tuple[int, ...]
    compute: np.ndarray
    activation: np.ndarray
    parameters: np.ndarray
    output: np.ndarray
    pred_mask: np.ndarray
    kind: str

    @property
    def num_states(self) -> int:
        return len(self.members)

    def pred_ids(self, j: int) -> np.ndarray:
        return np.flatnonzero(self.pred_mask[j])


def _bits(mask: int) -> list[int]:
    """Positions of the set bits of `mask`, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _closures(work: Workload) -> tuple[list[int], list[int]]:
    """Transitive ancestor and descendant bitsets (not including the node itself)."""
    n = work.num_nodes
    order = _topological(work)
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


def _topological(work: Workload) -> list[int]:
    """Kahn's algorithm, ties by node position (the Graph's own convention)."""
    import heapq

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


def antichain_states(work: Workload, max_states: Optional[int] = None) -> States:
    """PipeDream's antichain DAG (graph.py `antichain_dag`), topologically sorted as PipeDream sorts it.

    Raises `InfeasibleError` when more than `max_states` states exist (the caller falls back to prefixes).
    """
    n = work.num_nodes
    anc, desc = _closures(work)
    # augment(a) adds every ancestor p of an antichain node x that also feeds a node outside
    # ancestors(x) + {x}: such p's output is still live across the cut. It depends on x only.
    extra = [0] * n
    for x in range(n):
        keep = anc[x] | (1 << x)
        mask = 0
        for p in _bits(anc[x]):
            for s in work.succ[p]:
                if not (keep >> s) & 1:
                    mask |= 1 << p
                    break
        extra[x] = mask

    def augment(antichain: list[int]) -> list[int]:
        extras = 0
        for x in antichain:
            extras |= extra[x]
        # PipeDream writes list(set) + antichain; the set order does not change any cost (sums only).
        return _bits(extras) + list(antichain)

    def deaugment(nodes: list[int]) -> list[int]:
        members = 0
        for x in nodes:
            members |= 1 << x
        result, seen = [], 0
        for x in nodes:
            if desc[x] & members or (seen >> x) & 1:
                continue
            seen |= 1 << x
            result.append(x)
        return result

    def key(nodes: list[int]) -> int:
        mask = 0
        for x in nodes:
            mask |= 1 << x
        return mask

    sources = [v for v in range(n) if not work.pred[v]]
    start = [sources[0]]
    mapping: dict[int, int] = {key(start): 0}
    augmented: list[list[int]] = [augment(start)]
    out_edges: list[list[int]] = [[]]
    processed: set[int] = set()
    queue = deque([start])
    while queue:
        antichain = queue.popleft()
        akey = key(antichain)
        if akey in processed:
            continue
        processed.add(akey)
        aug = augment(antichain)
        aug_mask = key(aug)
        for u in aug:
            for v in work.succ[u]:
                if (akey >> v) & 1:
                    continue
                if desc[v] & aug_mask:  # is_next_antichain: no successor of v may sit in the cut
                    continue
                nxt = deaugment([v if x == u else x for x in aug])
                nkey = key(nxt)
                if nkey not in mapping:
                    mapping[nkey] = len(augmented)
                    augmented.append(augment(nxt))
                    out_edges.append([])
                    if max_states is not None and len(augmented) > max_states:
                        raise InfeasibleError(f"more than {max_states} antichain states")
                out_edges[mapping[akey]].append(mapping[nkey])
                queue.append(nxt)

    order = _dfs_topological(out_edges)
    return _finish_states(work, [augmented[s] for s in order], _reindex(out_edges, order), anc, "antichain")


def _dfs_topological(out_edges: list[list[int]]) -> list[int]:
    """PipeDream's `topological_sort`: reverse post-order of a DFS in insertion order (iterative here)."""
    marked = [False] * len(out_edges)
    post: list[int] = []
    for root in range(len(out_edges)):
        if marked[root]:
            continue
        marked[root] = True
        stack = [(root, iter(out_edges[root]))]
        while stack:
            node, children = stack[-1]
            for child in children:
                if not marked[child]:
                    marked[child] = True
                    stack.append((child, iter(out_edges[child])))
                    break
            else:
                stack.pop()
                post.append(node)
    return post[::-1]


def _reindex(out_edges: list[list[int]], order: list[int]) -> list[list[int]]:
    position = {s: i for i, s in enumerate(order)}
    return [[position[t] for t in out_edges[s]] for s in order]


def _finish_states(work: Workload, antichains: list[list[int]], out_edges: list[list[int]], anc: list[int], kind: str) -> States:
    num = len(antichains)
    members, compute, activation, parameters, output = [], [], [], [], []
    for nodes in antichains:
        mask = 0
        for x in nodes:
            mask |= anc[x] | (1 << x)
        members.append(mask)
        c = a = w = 0.0
        for v in _bits(mask):
            c += work.compute_s[v]
            a += work.activation[v]
            w += work.parameters[v]
        compute.append(c)
        activation.append(a)
        parameters.append(w)
        o = 0.0
        for x in nodes:
            o += work.activation[x]
        output.append(o)
    # Ancestor states, as bitsets over state positions, then as a boolean matrix.
    in_edges: list[list[int]] = [[] for _ in range(num)]
    for s, targets in enumerate(out_edges):
        for t in targets:
            in_edges[t].append(s)
    pred_bits = [0] * num
    for j in range(num):
        mask = 0
        for p in in_edges[j]:
            mask |= pred_bits[p] | (1 << p)
        pred_bits[j] = mask
    pred_mask = np.zeros((num, num), dtype=bool)
    for j in range(num):
        bits = _bits(pred_bits[j])
        if bits:
            pred_mask[j, bits] = True
    return States(
        members=tuple(members),
        compute=np.array(compute, dtype=np.float64),
        activation=np.array(activation, dtype=np.float64),
        parameters=np.array(parameters, dtype=np.float64),
        output=np.array(output, dtype=np.float64),
        pred_mask=pred_mask,
        kind=kind,
    )


def prefix_order(work: Workload) -> list[int]:
    """The topological order prefixes are taken from (Kahn, ties by file position)."""
    return _topological(work)


def prefix_states(work: Workload, with_pred_mask: bool = True) -> States:
    """States = prefixes of one topological order; `O(s)` = bytes of prefix nodes consumed after the cut."""
    order = prefix_order(work)
    n = len(order)
    position = {v: i for i, v in enumerate(order)}
    compute = np.cumsum([work.compute_s[v] for v in order])
    activation = np.cumsum([work.activation[v] for v in order])
    parameters = np.cumsum([work.parameters[v] for v in order])
    # A node's output is live across cut s (after position s) while s < its last consumer's position.
    delta = np.zeros(n + 1)
    for v in order:
        last = max((position[s] for s in work.succ[v]), default=position[v])
        if last > position[v]:
            delta[position[v]] += work.activation[v]
            delta[last] -= work.activation[v]
    output = np.cumsum(delta[:n])
    members = []
    mask = 0
    for v in order:
        mask |= 1 << v
        members.append(mask)
    pred_mask = np.tri(n, n, -1, dtype=bool) if with_pred_mask else np.zeros((0, 0), dtype=bool)
    return States(tuple(members), compute, activation, parameters, output, pred_mask, "topological")
