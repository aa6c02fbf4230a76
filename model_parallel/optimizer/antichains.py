"""PipeDream's antichain DAG: the cut states of its DP, enumerated breadth first from the graph's sources.

A state is an antichain of nodes; its cut `P(s)` is the antichain with all its ancestors. PipeDream
(graph.py `antichain_dag`) walks from the first source, replacing a node of the (augmented) antichain
by one of its successors. Two changes make the walk see every cut on graphs with several sources,
which traced models have (a parameter read per weight under `torch.export`, `x.shape[0]` read beside
the main branch, constants built from nothing), and leave PipeDream's one-source graphs untouched:

- a virtual root feeds every source and the walk starts there, so no source is unreachable (from one
  source only, the walk never cut a side branch that starts at another: timm's Mixer got one stage);
- a source that computes nothing and feeds exactly one node (a parameter read) travels with that
  node (`enumeration_view`): otherwise every subset of the weights not yet read is a cut of its own
  and the states grow as 2^weights (Llama: over 250,000 before the first layer).

Nodes the workload glues (`workload.glued_groups`: a value that cannot cross with its consumers, a
side effect with its anchor) are one view node, so no state splits them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from model_parallel.errors import InfeasibleError
from model_parallel.optimizer.downset_count import count_downsets
from model_parallel.optimizer.states import States
from model_parallel.optimizer.workload import (
    Workload, bit_positions, closures, glued_groups, masks_to_matrix, matrix_to_masks, topological_order,
)


@dataclass(frozen=True)
class Antichains:
    """PipeDream's antichain DAG as enumerated: per state its cut `P(s)` (a bitset over workload nodes),
    PipeDream's bytes crossing it (the augmented antichain's outputs) and the DAG's edges."""

    cuts: list[int]
    output: list[float]
    out_edges: list[list[int]]

    def __len__(self) -> int:
        return len(self.cuts)

    def downsets(self) -> list[int]:
        """`P(s)` of every state as a bitset (enumeration order)."""
        return list(self.cuts)


# PipeDream's DP keeps a states x states ancestry matrix (1 byte per pair) and tables of that size.
MAX_DP_STATES = 50_000


def antichain_states(work: Workload, max_states: Optional[int] = None) -> States:
    """PipeDream's antichain DAG (graph.py `antichain_dag`), topologically sorted as PipeDream sorts it.

    Raises `InfeasibleError` when more than `max_states` states exist (the caller falls back to prefixes).
    """
    return finish_antichains(work, enumerate_antichains(work, max_states))


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
        work, [found.cuts[s] for s in order], [found.output[s] for s in order], _reindex(found.out_edges, order),
    )


@dataclass(frozen=True)
class EnumerationView:
    """The graph the walk runs on: view node i stands for the workload nodes `groups[i]` (a bitset, its
    representative `nodes[i]` first among them); `always` are workload nodes inside every cut; `root`,
    when there is one, is the last view node and stands for no workload node."""

    work: Workload  # the view as a workload (structure only; its costs are zeros)
    nodes: tuple[int, ...]
    groups: tuple[int, ...]
    always: int
    root: Optional[int]
    output: tuple[float, ...] = ()  # bytes each view node sends on when it is in an antichain


def enumeration_view(work: Workload) -> EnumerationView:
    """The workload with the nodes whose place in a cut is decided by another node folded into it, plus
    a root before every remaining source when there are several.

    Why the cuts this drops lose nothing:
    - a *free* node (no compute, no parameters, no bytes: a shape read, `x.size(0)`, timm's `_assert`)
      joins a cut as soon as its inputs are in it (`always` when it needs none, else with its one
      predecessor that is not `always`). Any cut D and the cut D' with the free nodes D allows added
      have the same sums, and no more bytes cross D' (a free node sends nothing, and may consume an
      output that crossed D); the map keeps inclusion, so a plan over all cuts has a plan over these
      as fast, except that a stage holding only free nodes disappears (on one level with
      `use_fewer_machines` that loses nothing either);
    - a source that computes nothing and feeds one node (a weight read: a get_attr that the profiler
      places just before its single reader) is in a cut exactly when its reader is. A cut between them
      would send the weight forward as an activation and its gradient back on every microbatch,
      between two stages that both own it; the weight belongs to the stage that reads it.
    `tests/search/test_optimizer_real_graphs.py` checks plans over these cuts against brute force over all cuts.
    Glued nodes (`workload.glued_groups`) start as one group and are not folded elsewhere.
    """
    n = work.num_nodes
    free = [work.compute_s[v] == 0.0 and work.parameters[v] == 0.0 and work.activation[v] == 0.0 and work.wire[v] == 0.0
            for v in range(n)]
    if all(free):  # a profile without costs: every cut is alike, keep them all
        free = [False] * n
    owner = glued_groups(work)  # the node whose presence in a cut decides v's; -1 = every cut
    glued = {r for v, r in enumerate(owner) if r != v}
    for v in topological_order(work):
        if owner[v] != v or v in glued:
            continue  # its group decides
        if free[v]:
            deciding = {owner[p] for p in work.pred[v]} - {-1}
            if len(deciding) <= 1:
                owner[v] = deciding.pop() if deciding else -1
        elif not work.pred[v] and len(work.succ[v]) == 1 and work.compute_s[v] == 0.0:
            owner[v] = work.succ[v][0]  # its reader comes later in topological order: resolved below
    for v in range(n):  # follow the chain to its end (a weight read's reader may be folded too)
        while owner[v] >= 0 and owner[owner[v]] != owner[v]:
            owner[v] = owner[owner[v]]
    kept = [v for v in range(n) if owner[v] == v]
    position = {v: i for i, v in enumerate(kept)}
    groups = [0] * len(kept)
    always = 0
    for v in range(n):
        if owner[v] < 0:
            always |= 1 << v
        else:
            groups[position[owner[v]]] |= 1 << v
    succ: list[list[int]] = [[] for _ in kept]
    pred: list[list[int]] = [[] for _ in kept]
    for v in range(n):
        for t in work.succ[v]:
            a, b = owner[v], owner[t]
            if a >= 0 and b >= 0 and a != b and position[b] not in succ[position[a]]:
                succ[position[a]].append(position[b])
                pred[position[b]].append(position[a])
    # What a view node sends on: its representative's output (PipeDream's count), or for a glued group
    # the outputs of its members read outside the group.
    output = []
    for i, v in enumerate(kept):
        if v not in glued:
            output.append(work.wire[v])
            continue
        output.append(sum(work.wire[x] for x in bit_positions(groups[i])
                          if any(owner[t] != owner[x] for t in work.succ[x])))
    starts = [i for i, p in enumerate(pred) if not p]
    root = None
    if len(starts) > 1:
        root = len(kept)
        succ.append(starts)
        pred.append([])
        for i in starts:
            pred[i].append(root)
    size = len(succ)
    view = Workload(
        node_ids=tuple(work.node_ids[v] for v in kept) + (("<root>",) if root is not None else ()),
        compute_s=(0.0,) * size, activation=(0.0,) * size, wire=(0.0,) * size, parameters=(0.0,) * size,
        succ=tuple(tuple(s) for s in succ), pred=tuple(tuple(p) for p in pred), inputs=(), dropped=(),
    )
    return EnumerationView(view, tuple(kept), tuple(groups), always, root, tuple(output) + ((0.0,) if root is not None else ()))


def enumerate_antichains(work: Workload, max_states: Optional[int] = None, main_source_only: bool = False) -> Antichains:
    """Breadth-first enumeration of PipeDream's antichain DAG; `InfeasibleError` beyond `max_states`.

    `main_source_only`: PipeDream's own walk, from one source only (the one with the most descendants,
    no root), where other sources join a cut only with their first reader: some cuts, not all (a
    heuristic candidate set when all of them are too many; the last state need not hold every node).
    """
    view = enumeration_view(work)
    if main_source_only and view.root is not None:
        starts, graph = view.work.succ[view.root], view.work
        without_root = Workload(  # the root is the last view node: the walk must not step through it
            graph.node_ids[:-1], graph.compute_s[:-1], graph.activation[:-1], graph.wire[:-1], graph.parameters[:-1],
            graph.succ[:-1],
            tuple(tuple(p for p in preds if p != view.root) for preds in graph.pred[:-1]), (), (),
        )
        _, desc = closures(without_root)
        main = max(starts, key=lambda v: (desc[v].bit_count(), -v))
        found = _walk(without_root, max_states, start=main)
        return _cuts_of(work, replace(view, work=without_root, root=None), found)
    if max_states is not None:
        # The walk meets every non-empty downset of the view once (a minimal node outside a cut always
        # has a predecessor in its augmented antichain, the root's included): count them first, so a
        # graph with far too many states is refused in milliseconds instead of after `max_states` steps.
        count = count_downsets(view.work)
        states = None if count is None else count - 1 - (view.root is not None)  # not the empty cut, nor {root}
        if states is not None and states > max_states:
            raise InfeasibleError(f"more than {max_states} antichain states ({states})")
    found = _walk(view.work, max_states if view.root is None or max_states is None else max_states + 1)
    return _cuts_of(work, view, found)


def _cuts_of(work: Workload, view: EnumerationView, found: _Walk) -> Antichains:
    """The walk's states as cuts of the workload (the root's own state, the empty cut, dropped)."""
    root = view.root
    # The cut of view node x and its ancestors, in workload nodes (the root stands for nothing): built
    # from its predecessors' in topological order (linear in edges, not quadratic in nodes).
    below = [0] * view.work.num_nodes
    for x in topological_order(view.work):
        mask = view.always if x == root else view.always | view.groups[x]
        for p in view.work.pred[x]:
            mask |= below[p]
        below[x] = mask
    cuts, output = [], []
    for aug in found.augmented:
        mask, o = 0, 0.0
        for x in aug:
            if x != root:
                mask |= below[x]
                o += view.output[x]  # a group sends its representative's output (a glued one: what leaves it)
        cuts.append(mask)
        output.append(o)
    out_edges = found.out_edges
    if root is not None:  # the root's own state is the empty cut: no state of the DP
        cuts, output = cuts[1:], output[1:]
        out_edges = [[t - 1 for t in targets] for targets in out_edges[1:]]
    return Antichains(cuts, output, out_edges)


@dataclass(frozen=True)
class _Walk:
    augmented: list[list[int]]
    out_edges: list[list[int]]


def _walk(work: Workload, max_states: Optional[int], start: Optional[int] = None) -> _Walk:
    """PipeDream's breadth-first walk from the first source, or `start` (view positions throughout)."""
    n = work.num_nodes
    anc, desc = closures(work)
    # augment(a) adds every ancestor p of an antichain node x that also feeds a node outside
    # ancestors(x) + {x}: such p's output is still live across the cut. It depends on x only, and
    # for all x at once it is one boolean matrix product: feeds_outside[x, p] = any_s E[p, s] & ~keep[x, s].
    anc_matrix = masks_to_matrix(anc, n)
    keep = anc_matrix | np.eye(n, dtype=bool)
    adjacency = np.zeros((n, n), dtype=np.float32)
    for p, targets in enumerate(work.succ):
        adjacency[p, list(targets)] = 1.0
    feeds_outside = ((~keep).astype(np.float32) @ adjacency.T) > 0  # [x, p]
    extra = matrix_to_masks(anc_matrix & feeds_outside)

    def augment(antichain: list[int]) -> list[int]:
        extras = 0
        for x in antichain:
            extras |= extra[x]
        # PipeDream writes list(set) + antichain; the set order does not change any cost (sums only).
        return bit_positions(extras) + list(antichain)

    bit = [1 << x for x in range(n)]

    def key(nodes: list[int]) -> int:
        mask = 0
        for x in nodes:
            mask |= bit[x]
        return mask

    first = [next(v for v in range(n) if not work.pred[v]) if start is None else start]
    mapping: dict[int, int] = {key(first): 0}
    keys: list[int] = [key(first)]
    augmented: list[list[int]] = [augment(first)]
    out_edges: list[list[int]] = [[]]
    # Breadth first: PipeDream's queue meets each antichain first when it creates it (later copies are
    # skipped), so states are processed exactly in creation order.
    current = 0
    while current < len(augmented):
        akey, aug = keys[current], augmented[current]
        aug_mask = key(aug)
        extras = aug_mask & ~akey  # the augmentation: each an ancestor of some antichain node
        edges = out_edges[current]
        current += 1
        for index, u in enumerate(aug):
            bu = bit[u]
            for v in work.succ[u]:
                bv = bit[v]
                if akey & bv or desc[v] & aug_mask:  # is_next_antichain: no successor of v may sit in the cut
                    continue
                # PipeDream's deaugment of aug with u replaced by v keeps the members with no descendant
                # in the set. As a set, without visiting aug (dense graphs try ~250 (u, v) per state): an
                # antichain node has no descendant in aug (an extra below it would sit between two
                # antichain nodes), so it stays unless it is below v; an extra stays only when every
                # antichain node above it was u, so only u's ancestors are checked.
                members = (aug_mask ^ bu) | bv
                nkey = ((akey & ~bu) & ~anc[v]) | bv
                if akey & bu:
                    for p in bit_positions(extras & anc[u] & ~anc[v]):
                        if not desc[p] & members:
                            nkey |= bit[p]
                target = mapping.get(nkey)
                if target is None:
                    # The same nodes in aug's order (v where u was): the order of PipeDream's states.
                    nxt = [x for x in aug[:index] if nkey & bit[x]]
                    nxt.append(v)
                    nxt.extend([x for x in aug[index + 1:] if nkey & bit[x]])
                    target = mapping[nkey] = len(augmented)
                    keys.append(nkey)
                    augmented.append(augment(nxt))
                    out_edges.append([])
                    if max_states is not None and len(augmented) > max_states:
                        raise InfeasibleError(f"more than {max_states} antichain states")
                edges.append(target)
    return _Walk(augmented, out_edges)


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


def _finish_states(work: Workload, cuts: list[int], output: list[float], out_edges: list[list[int]]) -> States:
    num = len(cuts)
    # Sums over P(s) for every state at once; summation order differs from PipeDream's (set order)
    # only in the last bits.
    member_matrix = masks_to_matrix(cuts, work.num_nodes).astype(np.float64)
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
    pred_mask = masks_to_matrix(pred_bits, num)
    return States(
        members=tuple(cuts),
        compute=np.array(compute, dtype=np.float64),
        activation=np.array(activation, dtype=np.float64),
        parameters=np.array(parameters, dtype=np.float64),
        output=np.array(output, dtype=np.float64),
        pred_mask=pred_mask,
        kind="antichain",
    )
