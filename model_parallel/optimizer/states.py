"""Optimizer states: the cut points a partition may use, with cumulative costs.

A state s stands for a downward-closed set of nodes `P(s)` (everything computed before the cut).
The DP in `dp.py` only needs, per state, the cumulative compute/activation/parameter sums over `P(s)`,
the bytes crossing the cut `O(s)` (of `Workload.wire`; the activation sums are of `Workload.activation`,
what is held), and which states are ancestors of which. The state spaces:

- PipeDream's antichain DAG (`antichains.py`), reproduced one for one on PipeDream's graphs, so the DP
  gives PipeDream's numbers;
- `prefix_states`: the prefixes of one topological order of the nodes (n states, totally ordered).
  Cheap for any graph; every cut is valid; used by the straight-pipeline fast path and big graphs;
- `cut_states` / `ideal_states`: any downsets, with the bytes that really cross each cut.

Node sets are Python ints used as bitsets over node positions (`workload.py`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import numpy as np

from model_parallel.errors import InfeasibleError
# The workload is re-exported: most of the optimizer reads it together with the states.
from model_parallel.optimizer.workload import (  # noqa: F401
    Workload, crossing_bytes, glue_masks, glued_groups, masks_to_matrix, preprocess, respects_glue, topological_order,
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
    glued = glue_masks(work)
    return cut_states(work, [d for d in ideals if respects_glue(glued, d)], "all")


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
    members = masks_to_matrix(unique, n)
    adjacency = np.zeros((n, n), dtype=np.float32)
    for v, targets in enumerate(work.succ):
        adjacency[v, list(targets)] = 1.0
    out_degree = adjacency.sum(axis=1)
    per_node = np.array([work.compute_s, work.activation, work.parameters], dtype=np.float64).T  # (n, 3)
    wire = np.array(work.wire, dtype=np.float64)
    sums = np.empty((len(unique), 3))
    output = np.empty(len(unique))
    for start in range(0, len(unique), chunk):
        block = members[start:start + chunk]
        sums[start:start + chunk] = block @ per_node
        # A member crosses the cut when one of its successors is outside: fewer successors inside than it has.
        successors_inside = block.astype(np.float32) @ adjacency.T  # small integers, exact in float32
        output[start:start + chunk] = (block & (successors_inside < out_degree[None, :])) @ wire
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


def strict_inclusion(matrix: np.ndarray, block: int = 512) -> np.ndarray:
    """`[j, k]` True when state k (a row of the bool membership `matrix`) is strictly inside state j."""
    # k is inside j when no member of k is outside j: one AND per 64 node kinds of each pair, in row
    # blocks (a float matrix product over the kinds took 42 s and 9 GB for BERT's 47,190 bounded states).
    sizes = matrix.sum(axis=1)
    matrix = node_kinds(matrix)
    words = (matrix.shape[1] + 63) // 64
    padded = np.zeros((len(matrix), words * 64), dtype=bool)
    padded[:, : matrix.shape[1]] = matrix
    packed = np.packbits(padded, axis=1, bitorder="little").view(np.uint64)  # [state, word]
    outside = ~packed
    # States come in size order (cut_costs): only the columns no larger than a block's rows can be inside.
    ordered = bool(np.all(sizes[1:] >= sizes[:-1]))
    inside = np.zeros((len(matrix), len(matrix)), dtype=bool)
    for start in range(0, len(matrix), block):
        end = min(start + block, len(matrix))
        columns = int(np.searchsorted(sizes, sizes[end - 1], side="right")) if ordered else len(matrix)
        fits = (packed[None, :columns, 0] & outside[start:end, None, 0]) == 0
        for word in range(1, words):
            fits &= (packed[None, :columns, word] & outside[start:end, None, word]) == 0
        inside[start:end, :columns] = fits
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
    """The topological order prefixes are taken from (Kahn, ties by file position), with the members of
    each glued group (`workload.glued_groups`) next to each other: Kahn over the groups (ties by their
    first member's position), each group's members in their own order."""
    order = topological_order(work)
    rep = glued_groups(work)
    if all(r == v for v, r in enumerate(rep)):
        return order
    members: dict[int, list[int]] = {}
    for v in order:
        members.setdefault(rep[v], []).append(v)
    succ: dict[int, set[int]] = {r: set() for r in members}
    indegree = {r: 0 for r in members}
    for v in range(work.num_nodes):
        for t in work.succ[v]:
            if rep[t] != rep[v] and rep[t] not in succ[rep[v]]:
                succ[rep[v]].add(rep[t])
                indegree[rep[t]] += 1
    ready = [min(members[r]) for r in members if indegree[r] == 0]
    heapq.heapify(ready)
    grouped: list[int] = []
    while ready:
        r = rep[heapq.heappop(ready)]
        grouped += members[r]
        for t in succ[r]:
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, min(members[t]))
    return grouped


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
            delta[position[v]] += work.wire[v]
            delta[last] -= work.wire[v]
    output = np.cumsum(delta[:n])
    members = []
    mask = 0
    for v in order:
        mask |= 1 << v
        members.append(mask)
    # Only positions that end a glued group (all of them when nothing is glued) are cuts.
    rep = glued_groups(work)
    keep = np.array([i for i in range(n) if i == n - 1 or rep[order[i + 1]] != rep[order[i]]], dtype=np.int64)
    coarse = max_states is not None and len(keep) > max_states
    if coarse:
        keep = keep[_coarse_cuts(compute[keep], output[keep], max_states)]
    count = len(keep)
    return States(
        tuple(members[i] for i in keep), compute[keep], activation[keep], parameters[keep], output[keep],
        np.tri(count, count, -1, dtype=bool), "topological-coarse" if coarse else "topological",
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
