"""The cuts of PipeDream's antichain states alone, without its walk: what the search's bounded solves take.

PipeDream's walk (`antichains._walk`) meets every non-empty downset of the enumeration view once, and
each state's cut is that downset's workload nodes (plus the `always` ones). The search reads only these
cuts (`search/bounded.py` recomputes what crosses each), not the walk's order, augmented antichains or
edges, so here they come from the recursion that `downset_count.count_downsets` counts with: the downsets
of a set split on a node x into those without x and those holding x's ancestors, x and a downset of
the rest; parts with no edge between them combine every way. Each cut is one integer OR of smaller
lists' members (tens of nanoseconds), where the walk spends ~15 us a state in Python (BERT's 68,880:
1.2 s, here 0.05 s).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from model_parallel.errors import InfeasibleError
from model_parallel.optimizer.antichains import enumerate_antichains, enumeration_view
from model_parallel.optimizer.downset_count import connected_part, count_downsets, undirected_neighbours
from model_parallel.optimizer.workload import Workload, bit_positions, closures, topological_order


@dataclass(frozen=True)
class Downsets:
    """The distinct cuts (bitsets over workload nodes) of PipeDream's antichain states, in no particular order."""

    cuts: list[int]

    def __len__(self) -> int:
        return len(self.cuts)

    def downsets(self) -> list[int]:
        return list(self.cuts)


def enumerate_downsets(work: Workload, max_states: Optional[int] = None) -> Downsets:
    """The set of `enumerate_antichains(work).downsets()`; `InfeasibleError` beyond `max_states`.

    Where the recursion would split too many sets (`count_downsets` gives up), PipeDream's walk runs instead."""
    view = enumeration_view(work)
    count = count_downsets(view.work)
    if count is None:
        return Downsets(enumerate_antichains(work, max_states).downsets())
    states = count - 1 - (view.root is not None)  # not the empty cut, nor {root}
    if max_states is not None and states > max_states:
        raise InfeasibleError(f"more than {max_states} antichain states ({states})")
    graph = view.work
    n = graph.num_nodes
    anc, desc = closures(graph)
    image = [view.groups[x] if x != view.root else 0 for x in range(n)]  # the root stands for no workload node
    neighbours = undirected_neighbours(graph)
    position = {v: i for i, v in enumerate(topological_order(graph))}
    memo: dict[int, list[int]] = {}

    def component(mask: int) -> int:
        return connected_part(mask, neighbours)

    def ideals(mask: int) -> list[int]:
        """The workload images of every downset of the view nodes in `mask` (the empty one included)."""
        if not mask:
            return [0]
        if mask & (mask - 1) == 0:
            return [0, image[mask.bit_length() - 1]]
        known = memo.get(mask)
        if known is not None:
            return known
        part = component(mask)
        if part != mask:
            rest = ideals(mask & ~part)
            result = [a | b for a in ideals(part) for b in rest]
        else:
            members = bit_positions(mask)
            members.sort(key=position.__getitem__)
            x = members[len(members) // 2]  # as count_downsets splits: the same sets, already counted
            below = 0
            for y in bit_positions(mask & (anc[x] | 1 << x)):
                below |= image[y]
            result = ideals(mask & ~(desc[x] | 1 << x)) + [below | b for b in ideals(mask & ~(anc[x] | 1 << x))]
        memo[mask] = result
        return result

    # Every non-empty downset holds the root (or the one source): only the empty one, and {root}, map to 0.
    return Downsets([view.always | cut for cut in ideals((1 << n) - 1) if cut])
