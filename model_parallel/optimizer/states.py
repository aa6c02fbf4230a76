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

import heapq
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


def _to_matrix(masks: list[int], n: int) -> np.ndarray:
    """Bitsets -> boolean matrix, row i = bits of masks[i] (bit v at column v)."""
    width = (n + 7) // 8
    raw = b"".join(m.to_bytes(width, "little") for m in masks)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8).reshape(len(masks), width), axis=1, bitorder="little")
    return bits[:, :n].astype(bool)


def _from_matrix(matrix: np.ndarray) -> list[int]:
    packed = np.packbits(matrix, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


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
    return finish_antichains(work, enumerate_antichains(work, max_states))


@dataclass(frozen=True)
class Antichains:
    """PipeDream's antichain DAG as enumerated: augmented antichains (node positions), the DAG's edges
    and every node's ancestor bitset."""

    augmented: list[list[int]]
    out_edges: list[list[int]]
    ancestors: list[int]

    def __len__(self) -> int:
        return len(self.augmented)

    def downsets(self) -> list[int]:
        """`P(s)` of every state as a bitset (enumeration order)."""
        result = []
        for nodes in self.augmented:
            mask = 0
            for x in nodes:
                mask |= self.ancestors[x] | (1 << x)
            result.append(mask)
        return result


# PipeDream's DP keeps a states x states ancestry matrix (1 byte per pair) and tables of that size.
MAX_DP_STATES = 50_000


def finish_antichains(work: Workload, found: Antichains) -> States:
    """PipeDream's state order and costs for an enumerated antichain DAG."""
    if len(found) > MAX_DP_STATES:
        raise InfeasibleError(
            f"PipeDream's state space has {len(found)} antichain states: its DP would need "
            f"{len(found) ** 2 / 2**30:.1f} GiB for the state order alone; use cuts='auto' (an exact bounded solve "
            "where one exists) or cuts='topological'"
        )
    order = _dfs_topological(found.out_edges)
    return _finish_states(
        work, [found.augmented[s] for s in order], _reindex(found.out_edges, order), found.ancestors, "antichain"
    )


def enumerate_antichains(work: Workload, max_states: Optional[int] = None) -> Antichains:
    """Breadth-first enumeration of PipeDream's antichain DAG; `InfeasibleError` beyond `max_states`."""
    n = work.num_nodes
    anc, desc = _closures(work)
    # augment(a) adds every ancestor p of an antichain node x that also feeds a node outside
    # ancestors(x) + {x}: such p's output is still live across the cut. It depends on x only, and
    # for all x at once it is one boolean matrix product: feeds_outside[x, p] = any_s E[p, s] & ~keep[x, s].
    anc_matrix = _to_matrix(anc, n)
    keep = anc_matrix | np.eye(n, dtype=bool)
    adjacency = np.zeros((n, n), dtype=np.float32)
    for p, targets in enumerate(work.succ):
        adjacency[p, list(targets)] = 1.0
    feeds_outside = ((~keep).astype(np.float32) @ adjacency.T) > 0  # [x, p]
    extra = _from_matrix(anc_matrix & feeds_outside)

    def augment(antichain: list[int]) -> list[int]:
        extras = 0
        for x in antichain:
            extras |= extra[x]
        # PipeDream writes list(set) + antichain; the set order does not change any cost (sums only).
        return _bits(extras) + list(antichain)

    bit = [1 << x for x in range(n)]

    def key(nodes: list[int]) -> int:
        mask = 0
        for x in nodes:
            mask |= bit[x]
        return mask

    sources = [v for v in range(n) if not work.pred[v]]
    start = [sources[0]]
    mapping: dict[int, int] = {key(start): 0}
    keys: list[int] = [key(start)]
    augmented: list[list[int]] = [augment(start)]
    out_edges: list[list[int]] = [[]]
    # Breadth first: PipeDream's queue meets each antichain first when it creates it (later copies are
    # skipped), so states are processed exactly in creation order.
    current = 0
    while current < len(augmented):
        akey, aug = keys[current], augmented[current]
        aug_mask = key(aug)
        edges = out_edges[current]
        current += 1
        for index, u in enumerate(aug):
            before, after = aug[:index], aug[index + 1:]
            for v in work.succ[u]:
                if akey & bit[v] or desc[v] & aug_mask:  # is_next_antichain: no successor of v may sit in the cut
                    continue
                # PipeDream's deaugment of aug with u replaced by v: keep the nodes with no descendant in
                # the set, in order (v has none there: checked above; nodes of aug are distinct).
                members = (aug_mask ^ bit[u]) | bit[v]
                nxt = [x for x in before if not desc[x] & members]
                nxt.append(v)
                nxt.extend([x for x in after if not desc[x] & members])
                nkey = key(nxt)
                target = mapping.get(nkey)
                if target is None:
                    target = mapping[nkey] = len(augmented)
                    keys.append(nkey)
                    augmented.append(augment(nxt))
                    out_edges.append([])
                    if max_states is not None and len(augmented) > max_states:
                        raise InfeasibleError(f"more than {max_states} antichain states")
                edges.append(target)
    return Antichains(augmented, out_edges, anc)


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
    members, output = [], []
    for nodes in antichains:
        mask = 0
        o = 0.0
        for x in nodes:
            mask |= anc[x] | (1 << x)
            o += work.activation[x]
        members.append(mask)
        output.append(o)
    # Sums over P(s) for every state at once; summation order differs from PipeDream's (set order)
    # only in the last bits.
    member_matrix = _to_matrix(members, work.num_nodes).astype(np.float64)
    compute = member_matrix @ np.array(work.compute_s, dtype=np.float64)
    activation = member_matrix @ np.array(work.activation, dtype=np.float64)
    parameters = member_matrix @ np.array(work.parameters, dtype=np.float64)
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
    pred_mask = _to_matrix(pred_bits, num)
    return States(
        members=tuple(members),
        compute=np.array(compute, dtype=np.float64),
        activation=np.array(activation, dtype=np.float64),
        parameters=np.array(parameters, dtype=np.float64),
        output=np.array(output, dtype=np.float64),
        pred_mask=pred_mask,
        kind=kind,
    )


def crossing_bytes(work: Workload, mask: int) -> float:
    """Bytes of the nodes in `mask` consumed by a node outside it: what really crosses that cut."""
    total = 0.0
    for v in _bits(mask):
        if any(not (mask >> s) & 1 for s in work.succ[v]):
            total += work.activation[v]
    return total


def ideal_states(work: Workload, max_states: int = 4096) -> States:
    """Every non-empty downward-closed node set (all valid cuts), ordered by size; `O` = true crossing bytes.

    Exponential in the graph's width: for small graphs (exhaustive checks, `cuts="all"`).
    """
    n = work.num_nodes
    pred_masks = [sum(1 << p for p in work.pred[v]) for v in range(n)]
    seen = {0}
    frontier = [0]
    ideals: list[int] = []
    while frontier:
        nxt = []
        for mask in frontier:
            for v in range(n):
                if not (mask >> v) & 1 and pred_masks[v] & ~mask == 0:
                    grown = mask | (1 << v)
                    if grown not in seen:
                        seen.add(grown)
                        nxt.append(grown)
                        if len(seen) > max_states + 1:
                            raise InfeasibleError(
                                f"more than {max_states} valid cuts: cuts='all' is for small graphs; use 'antichain' or 'topological'"
                            )
        nxt.sort()
        ideals.extend(nxt)
        frontier = nxt
    return cut_states(work, ideals, "all")


@dataclass(frozen=True)
class CutCosts:
    """Distinct downsets ordered by size (a linear extension of inclusion) with their sums and the
    bytes that really cross each cut."""

    members: tuple[int, ...]
    matrix: np.ndarray  # bool [state, node]
    compute: np.ndarray
    activation: np.ndarray
    parameters: np.ndarray
    output: np.ndarray

    def subset(self, keep: np.ndarray) -> "CutCosts":
        chosen = np.flatnonzero(keep)
        return CutCosts(tuple(self.members[i] for i in chosen), self.matrix[chosen], self.compute[chosen],
                        self.activation[chosen], self.parameters[chosen], self.output[chosen])


def cut_costs(work: Workload, downsets: list[int], chunk: int = 8192) -> CutCosts:
    """Sums and crossing bytes of arbitrary downsets (bitsets; duplicates merged), vectorised in
    chunks of states (only the boolean membership matrix is kept whole)."""
    n = work.num_nodes
    unique = sorted(set(downsets), key=lambda mask: (mask.bit_count(), mask))
    members = _to_matrix(unique, n)
    adjacency = np.zeros((n, n), dtype=np.float32)
    for v, targets in enumerate(work.succ):
        adjacency[v, list(targets)] = 1.0
    out_degree = adjacency.sum(axis=1)
    per_node = np.array([work.compute_s, work.activation, work.parameters], dtype=np.float64).T  # (n, 3)
    sums = np.empty((len(unique), 3))
    output = np.empty(len(unique))
    for start in range(0, len(unique), chunk):
        block = members[start:start + chunk]
        sums[start:start + chunk] = block @ per_node
        # A member crosses the cut when one of its successors is outside: fewer successors inside than it has.
        successors_inside = block.astype(np.float32) @ adjacency.T  # small integers, exact in float32
        output[start:start + chunk] = (block & (successors_inside < out_degree[None, :])) @ per_node[:, 1]
    return CutCosts(
        members=tuple(unique), matrix=members,
        compute=sums[:, 0].copy(), activation=sums[:, 1].copy(), parameters=sums[:, 2].copy(), output=output,
    )


def cut_states(work: Workload, downsets: list[int], kind: str) -> States:
    """States for arbitrary downsets: ordered by size, `O` = the bytes that really cross each cut."""
    return states_from_costs(cut_costs(work, downsets), kind)


def states_from_costs(costs: CutCosts, kind: str) -> States:
    """`CutCosts` as DP states: `pred_mask` = strict inclusion (a boolean matrix product)."""
    return States(
        members=costs.members,
        compute=costs.compute,
        activation=costs.activation,
        parameters=costs.parameters,
        output=costs.output,
        pred_mask=strict_inclusion(costs.matrix),
        kind=kind,
    )


def strict_inclusion(matrix: np.ndarray) -> np.ndarray:
    """`[j, k]` True when state k (a row of the bool membership `matrix`) is strictly inside state j."""
    # k is inside j when no member of k is outside j.
    matrix = node_kinds(matrix)
    inside = ((~matrix).astype(np.float32) @ matrix.astype(np.float32).T) == 0  # [j, k]
    np.fill_diagonal(inside, False)
    return inside


def node_kinds(matrix: np.ndarray) -> np.ndarray:
    """The bool membership `matrix` [state, node] with one column per distinct column: nodes in the same
    states answer "is k inside j" alike (few kinds when the states are a subset, e.g. a bounded solve's windows)."""
    kinds = np.unique(np.packbits(matrix, axis=0).T, axis=0, return_index=True)[1]
    return matrix[:, np.sort(kinds)]


def downset_sums(work: Workload, downsets: list[int], chunk: int = 16384) -> np.ndarray:
    """Compute seconds over each downset (for bounding before the states are built): a table of the sum
    over each byte's 8 nodes for each of its 256 values, read once per byte of each bitset (no states x
    nodes matrix; sums in another order than `cut_costs`, which bounding absorbs)."""
    n = work.num_nodes
    width = (n + 7) // 8
    compute = np.zeros(width * 8)
    compute[:n] = work.compute_s
    byte_bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(np.float64)
    table = compute.reshape(width, 8) @ byte_bits.T  # [byte position, byte value]
    positions = np.arange(width)[None, :]
    sums = np.empty(len(downsets))
    for start in range(0, len(downsets), chunk):
        block = downsets[start:start + chunk]
        raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in block), dtype=np.uint8).reshape(len(block), width)
        sums[start:start + chunk] = table[positions, raw].sum(axis=1)
    return sums


def prefix_order(work: Workload) -> list[int]:
    """The topological order prefixes are taken from (Kahn, ties by file position)."""
    return _topological(work)


def prefix_states(work: Workload, max_states: Optional[int] = None) -> States:
    """States = prefixes of one topological order; `O(s)` = bytes of prefix nodes consumed after the cut.

    With `max_states`, only that many cut positions are kept (a heuristic for huge graphs): the order
    is split into `max_states` pieces of equal compute and each piece ends at its cheapest cut (fewest
    bytes crossing); the last position always stays.
    """
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
    keep = np.arange(n)
    if max_states is not None and n > max_states:
        keep = _coarse_cuts(compute, output, max_states)
    count = len(keep)
    return States(
        tuple(members[i] for i in keep), compute[keep], activation[keep], parameters[keep], output[keep],
        np.tri(count, count, -1, dtype=bool), "topological" if count == n else "topological-coarse",
    )


def _coarse_cuts(compute: np.ndarray, output: np.ndarray, max_states: int) -> np.ndarray:
    total = compute[-1] if compute[-1] > 0 else 1.0
    piece = np.minimum((compute / total * max_states).astype(np.int64), max_states - 1)
    keep = []
    for p in np.unique(piece):
        positions = np.flatnonzero(piece == p)
        latest_first = positions[::-1]  # ties go to the latest position: bigger earlier stages
        keep.append(int(latest_first[np.argmin(output[latest_first])]))
    keep = sorted(set(keep) | {len(compute) - 1})
    return np.array(keep, dtype=np.int64)
