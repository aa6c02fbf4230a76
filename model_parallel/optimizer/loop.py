"""Several stages per rank priced by rank: a rank's time is the sum of its stages' cost over its speed, and
`loop_rank_plan` (p*v stages, stage k on rank k % p) and `v_rank_plan` (2p stages in a V: stage k on rank k for
k < p, 2p-1-k after) minimise the slowest rank. Both are `rank_sum_plan`, which takes the rank of every stage.

The straight solver (stage k priced at its rank's speed) gives the start: it bounds every stage, not every rank.
`balance_cuts` then moves one cut, then two cuts together, then three (where none of those helps, in a smaller
budget), to their best positions (the slowest rank, then the sum of squared rank times: the most even split at
that bottleneck) until no move helps. Moving a cut trades work between two ranks only, and errors on a rank's
stages may cancel, which the per-stage bound cannot see. Neighbours on one rank (the V's stages p-1 and p) are
searched as one segment (`merged_balance`).
This local search is not proven optimal: tests/unit/optimizer/test_loop.py checks it against brute force on a
reference profile (the optimum) and against the ideal split on synthetic chains (within one node's time);
tests/unit/optimizer/test_v_plan.py checks the V against brute force on small chains (exact on 2 ranks).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Optional

import numpy as np

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.assemble import assign_nodes, build_plan, infeasible_message
from model_parallel.optimizer.dp import Part
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import choose_states
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.states import preprocess

MAX_PASSES = 30  # each pass moves every cut at most once; real graphs settle in a few (the rest: evening out)
# Candidate placements (rows x stages) the search may price in all: a bound in array elements, never seconds,
# so the same input gives the same plan on any machine; about a second of numpy at worst (2 cores, loaded).
BUDGET = 20_000_000
# Of it, moves of three cuts (tried only where no one or two cuts help) may price this many: they settle small chains
# (a V's nested segments) and rarely help long ones, where pairs already land within a node of the ideal.
TRIPLE_BUDGET = 1_000_000


def is_loop(ranks: Sequence[int]) -> bool:
    """`ranks` (one per stage, in stage order) is a loop placement: p >= 2 distinct ranks, p*v stages (v >= 2),
    stage k on the rank of stage k % p."""
    p = len(set(ranks))
    return p >= 2 and len(ranks) > p and len(ranks) % p == 0 and all(r == ranks[k % p] for k, r in enumerate(ranks))


def is_v(ranks: Sequence[int]) -> bool:
    """`ranks` (one per stage, in stage order) is a V placement: 2p stages over p >= 2 distinct ranks, stage k on
    the rank of stage 2p-1-k (stage p-1 hands to stage p on its own rank)."""
    p = len(ranks) // 2
    return p >= 2 and len(ranks) == 2 * p and len(set(ranks[:p])) == p and \
        all(ranks[k] == ranks[2 * p - 1 - k] for k in range(p))


def rank_speeds(ranks: Sequence[int], speeds: Sequence[float]) -> dict[int, float]:
    """One speed per rank from speeds given per stage (a rank's stages carry its speed; the first one counts)."""
    if len(speeds) != len(ranks):
        raise PlanError(f"got {len(speeds)} speed(s) for {len(ranks)} stage(s); give one speed per stage")
    out: dict[int, float] = {}
    for rank, speed in zip(ranks, speeds):
        out.setdefault(int(rank), float(speed))
    if any(not s > 0 for s in out.values()):
        raise PlanError(f"worker speeds must be > 0, got {out}")
    return out


def rank_times(stage_costs: Sequence[float], ranks: Sequence[int], speeds: Mapping[int, float]) -> dict[int, float]:
    """Each rank's time: the sum of its stages' costs over its speed (moving a cut between two stages of one
    rank changes nothing)."""
    totals: dict[int, float] = {}
    for cost, rank in zip(stage_costs, ranks):
        totals[rank] = totals.get(rank, 0.0) + float(cost)
    return {r: t / speeds[r] for r, t in totals.items()}


def balance_cuts(prefix: np.ndarray, ends: Sequence[int], ranks: Sequence[int], speeds: Mapping[int, float],
                 sizes: Optional[Sequence[int]] = None) -> list[int]:
    """Cut ends (stage i covers positions ends[i-1] .. ends[i]-1 of `prefix`, the running cost sums; the last end
    is len(prefix)) moved, one cut, then two, then three at a time, to the positions that lower (slowest rank, sum
    of squared rank times), until no move does; stage i keeps at least `sizes[i]` positions (default 1)."""
    least = [1] * len(ends) if sizes is None else [int(n) for n in sizes]
    cum = np.concatenate([[0.0], np.asarray(prefix, dtype=float)])  # cum[e]: cost of positions < e
    ends = [int(e) for e in ends]
    order = sorted(set(ranks))
    onehot = np.zeros((len(ends), len(order)))
    onehot[np.arange(len(ends)), [order.index(r) for r in ranks]] = 1.0
    onehot /= np.array([speeds[r] for r in order]) * (float(cum[-1]) or 1.0)  # rank times, near 1

    def keys(candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slowest rank rounded, sum of squares) of each row of candidate ends."""
        starts = np.concatenate([np.zeros((len(candidates), 1), dtype=np.int64), candidates[:, :-1]], axis=1)
        times = (cum[candidates] - cum[starts]) @ onehot
        return np.round(times.max(axis=1), 12), (times ** 2).sum(axis=1)

    spent = [0, 0]  # elements priced: all moves, moves of three cuts

    def placements(cuts: tuple[int, ...]) -> Optional[np.ndarray]:
        """Every placement of `cuts` (rows, in lexicographic order), the others fixed, every stage keeping its least
        positions; None when there are clearly more than the budget allows (not built)."""
        axes = []
        for cut in cuts:
            before = max([c for c in range(-1, cut) if c not in cuts])  # the nearest fixed end before (-1: position 0)
            after = min(c for c in range(cut + 1, len(ends)) if c not in cuts)  # the nearest fixed end after
            low = (ends[before] if before >= 0 else 0) + sum(least[before + 1:cut + 1])
            axes.append(np.arange(low, ends[after] - sum(least[cut + 1:after + 1]) + 1))
        # k moved cuts side by side keep about 1/k! of the product (they stay in order): the budget itself is checked
        # on what is kept, by the caller.
        limit = (TRIPLE_BUDGET if len(cuts) > 2 else BUDGET) * math.factorial(len(cuts))
        if math.prod(len(a) for a in axes) * len(ends) > limit:
            return None
        grid = np.stack([a.ravel() for a in np.meshgrid(*axes, indexing="ij")], axis=1).reshape(-1, len(cuts))
        for k in range(1, len(cuts)):  # adjacent moved cuts: the stage between keeps its least
            if cuts[k] == cuts[k - 1] + 1:
                grid = grid[grid[:, k] - grid[:, k - 1] >= least[cuts[k]]]
        return grid

    def improve(cuts: tuple[int, ...]) -> bool:
        """Every placement of `cuts` (the others fixed): take the best if it is better than now (several cuts: only
        if the slowest rank gets faster, else long chains of tiny evenings)."""
        grid = placements(cuts)
        cost = 0 if grid is None else len(grid) * len(ends)
        if not cost or spent[0] + cost > BUDGET or (len(cuts) > 2 and spent[1] + cost > TRIPLE_BUDGET):
            return False
        spent[0] += cost
        spent[1] += cost if len(cuts) > 2 else 0
        candidates = np.tile(np.array(ends), (len(grid) + 1, 1))
        candidates[1:, list(cuts)] = grid  # row 0: the cuts as they are
        worst, squares = keys(candidates)
        best = int(np.lexsort((squares, worst))[0])  # by slowest rank, then sum of squares
        if (worst[best], squares[best]) >= (worst[0], squares[0]) or (len(cuts) > 1 and worst[best] >= worst[0]):
            return False
        for cut, value in zip(cuts, candidates[best, list(cuts)]):
            ends[cut] = int(value)
        return True

    singles = [(i,) for i in range(len(ends) - 1)]
    pairs = list(itertools.combinations(range(len(ends) - 1), 2))
    triples = list(itertools.combinations(range(len(ends) - 1), 3))  # only where pairs are stuck, in the budget
    for _ in range(MAX_PASSES):
        if not any([improve(c) for c in singles]) and not any(improve(c) for c in pairs) and \
                not any(improve(c) for c in triples):
            break  # (also when the budget is spent: every move then says no)
    return ends


def merged_balance(prefix: np.ndarray, ends: Sequence[int], ranks: Sequence[int], speeds: Mapping[int, float]) -> list[int]:
    """`balance_cuts` with neighbours on one rank (the V's stages p-1 and p) searched as one segment: the cut between
    them changes no rank's time, so searched as a cut it would only hold both back (each must keep a position);
    each such segment is then cut in its stages at even cost."""
    groups: list[list[int]] = []  # stage indices, consecutive ones on one rank together
    for k, rank in enumerate(ranks):
        if groups and ranks[groups[-1][-1]] == rank:
            groups[-1].append(k)
        else:
            groups.append([k])
    merged = balance_cuts(prefix, [ends[g[-1]] for g in groups], [ranks[g[0]] for g in groups], speeds,
                          [len(g) for g in groups])
    cum = np.concatenate([[0.0], np.asarray(prefix, dtype=float)])
    out: list[int] = []
    for group, end in zip(groups, merged):
        start = previous = out[-1] if out else 0
        for n in range(1, len(group)):  # the n-th even share of the segment's cost, each stage keeping a position
            target = cum[start] + (cum[end] - cum[start]) * n / len(group)
            previous = int(np.clip(np.searchsorted(cum, target), previous + 1, end - (len(group) - n)))
            out.append(previous)
        out.append(end)
    return out


def loop_rank_plan(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """`rank_sum_plan` for a loop placement (`is_loop`: stage k on the rank of stage k % p): the optimizer's and
    the live rebalancer's loop plans."""
    if not is_loop(ranks):
        raise PlanError(f"a loop placement puts stage k on the rank of stage k % p over p >= 2 ranks with p*v stages "
                        f"(v >= 2); got ranks {list(ranks)[:12]}")
    return rank_sum_plan(graph, ranks, speeds)


def v_rank_plan(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """`rank_sum_plan` for a V placement (`is_v`: 2p stages, stage k on the rank of stage 2p-1-k): the live
    rebalancer's zbv plans. The cut between stages p-1 and p (one rank's two halves) changes no rank's time."""
    if not is_v(ranks):
        raise PlanError(f"a V placement puts 2p stages on p >= 2 ranks, stage k on the rank of stage 2p-1-k; got ranks "
                        f"{list(ranks)[:12]}")
    return rank_sum_plan(graph, ranks, speeds)


def rank_sum_plan(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """`len(ranks)` contiguous stages over one topological order, stage k on `ranks[k]` (any placement; the loop
    and the V through `loop_rank_plan` and `v_rank_plan`), minimising the slowest rank's summed stage cost over its
    speed (`speeds`: one per stage, a rank's stages carry its speed). Nodes are priced by their `compute_ms` as
    given: an untimed graph is priced by the caller (`contiguous.priced_graph`, the policy's `with_cost_proxy`)."""
    by_rank = rank_speeds(ranks, speeds)
    count = len(ranks)
    options = PartitionOptions(straight_pipeline=True, cuts="topological",
                               worker_speeds=tuple(by_rank[int(r)] for r in ranks))
    hierarchy = Hierarchy.from_lists([count])
    work = preprocess(graph, options.memory_model)
    states = choose_states(work, hierarchy, options)
    if states.num_states < count:
        raise PlanError(f"cannot split {states.num_states} cut point(s) into {count} stage(s); use fewer stages per rank")
    solution = solve(states, hierarchy, options)
    if not math.isfinite(solution.time_s):
        raise InfeasibleError(infeasible_message(graph, work, hierarchy, options, states))
    ends = merged_balance(states.compute, [part.end for part in solution.parts], [int(r) for r in ranks], by_rank)
    starts = [0] + ends[:-1]
    parts = tuple(Part(s, e, 1) for s, e in zip(starts, ends))
    costs = [float(states.compute[e - 1] - (states.compute[s - 1] if s else 0.0)) for s, e in zip(starts, ends)]
    solution = replace(solution, parts=parts, time_s=max(rank_times(costs, ranks, by_rank).values()))
    # No clock here (test_tuning: the optimizer never reads it); the plan's optimizer_seconds stays 0.
    plan = build_plan(graph, hierarchy, options, solution, assign_nodes(graph, work, solution), 0.0)
    return replace(plan, stages=tuple(replace(s, ranks=(int(ranks[i]),)) for i, s in enumerate(plan.stages)),
                   extra={**plan.extra, "time_per_minibatch_of": "slowest rank, its stages summed"})
