"""How many cuts (downsets) a graph has, counted without listing them: whether PipeDream's walk fits a state budget."""
from __future__ import annotations

from typing import Optional

from model_parallel.optimizer.workload import Workload, bit_positions, closures, topological_order


def undirected_neighbours(work: Workload) -> list[int]:
    """Per node, the bit mask of the nodes joined to it by an edge either way."""
    neighbours = [0] * work.num_nodes
    for v in range(work.num_nodes):
        for s in work.succ[v]:
            neighbours[v] |= 1 << s
            neighbours[s] |= 1 << v
    return neighbours


def connected_part(mask: int, neighbours: list[int]) -> int:
    """The connected part of the nodes in `mask` that holds its lowest node."""
    seed = mask & -mask
    part, frontier = seed, seed
    while frontier:
        grown = 0
        for v in bit_positions(frontier):
            grown |= neighbours[v]
        frontier = grown & mask & ~part
        part |= frontier
    return part


def count_downsets(work: Workload, max_calls: int = 20_000) -> Optional[int]:
    """The number of downward-closed node sets (the empty one included), or None when counting would
    take more than `max_calls` steps.

    Ideals of a set P split on any node x into those without x (the ideals of P minus x's descendants)
    and those with it (P minus x's ancestors, each joined with them): #I(P) = #I(P - up(x)) + #I(P - down(x));
    the ideals of parts with no edge between them multiply. Every set met is an intersection of down-
    and up-closed sets, so the graph's direct edges inside it give its whole order. Side branches that
    run beside each other (a model's mask and rotary tables beside its embedding) are what makes the
    states explode, and they are exactly the parts that multiply here.
    """
    n = work.num_nodes
    anc, desc = closures(work)
    neighbours = undirected_neighbours(work)
    position = {v: i for i, v in enumerate(topological_order(work))}
    memo: dict[int, int] = {}
    calls = 0

    def component(mask: int) -> int:
        return connected_part(mask, neighbours)

    def count(mask: int) -> int:
        nonlocal calls
        if not mask:
            return 1
        if mask & (mask - 1) == 0:
            return 2
        known = memo.get(mask)
        if known is not None:
            return known
        calls += 1
        if calls > max_calls:
            raise _TooMany
        part = component(mask)
        if part != mask:
            result = count(part) * count(mask & ~part)
        else:
            members = bit_positions(mask)
            members.sort(key=position.__getitem__)
            x = members[len(members) // 2]  # the middle of a topological order splits chains in halves
            result = count(mask & ~(desc[x] | 1 << x)) + count(mask & ~(anc[x] | 1 << x))
        memo[mask] = result
        return result

    try:
        return count((1 << n) - 1)
    except _TooMany:
        return None


class _TooMany(Exception):
    """`count_downsets` ran out of steps."""
