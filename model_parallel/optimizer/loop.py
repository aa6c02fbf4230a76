"""Loop placements graph by rank: p*v contiguous stages, stage k on the k-th rank given (rank k % p), a rank's
time the sum of its stages' cost over its speed; `loop_rank_plan` minimises the slowest rank.

The straight solver (stage k graph at its rank's speed) gives the start: it bounds every stage, not every rank.
`balance_cuts` then moves one cut at a time to its best position between its neighbours (the slowest rank,
then the sum of squared rank times: the most even split at that bottleneck) until no cut moves. Moving a cut
between two stages trades work between two ranks only, and errors on a rank's v stages may cancel, which the
per-stage bound cannot see. Coordinate descent is not proven optimal; tests/unit/optimizer/test_loop.py
checks it against brute force on small graphs.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Hierarchy, Plan
from model_parallel.optimizer.assemble import assign_nodes, build_plan, infeasible_message
from model_parallel.optimizer.dp import Part
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import choose_states
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.states import preprocess

MAX_PASSES = 200  # each pass moves every cut at most once; real graphs settle in a few


def is_loop(ranks: Sequence[int]) -> bool:
    """`ranks` (one per stage, in stage order) is a loop placement: p >= 2 distinct ranks, p*v stages (v >= 2),
    stage k on the rank of stage k % p."""
    p = len(set(ranks))
    return p >= 2 and len(ranks) > p and len(ranks) % p == 0 and all(r == ranks[k % p] for k, r in enumerate(ranks))


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


def balance_cuts(prefix: np.ndarray, ends: Sequence[int], ranks: Sequence[int], speeds: Mapping[int, float]) -> list[int]:
    """Cut ends (stage i covers positions ends[i-1] .. ends[i]-1 of `prefix`, the running cost sums; the last end
    is len(prefix)) moved one at a time to the position that lowers (slowest rank, sum of squared rank times)."""
    cum = np.concatenate([[0.0], np.asarray(prefix, dtype=float)])  # cum[e]: cost of positions < e
    ends = [int(e) for e in ends]
    order = sorted(set(ranks))
    index = {r: i for i, r in enumerate(order)}
    speed = np.array([speeds[r] for r in order])
    scale = float(cum[-1]) or 1.0

    def totals() -> np.ndarray:
        work = np.zeros(len(order))
        start = 0
        for i, end in enumerate(ends):
            work[index[ranks[i]]] += cum[end] - cum[start]
            start = end
        return work / speed / scale

    def key(times: np.ndarray) -> tuple[float, float]:
        return round(float(times.max()), 12), float((times ** 2).sum())

    for _ in range(MAX_PASSES):
        moved = False
        for i in range(len(ends) - 1):
            lo, hi = (ends[i - 1] if i else 0), ends[i + 1]
            if hi - lo < 2:
                continue  # both stages hold one position: nothing to move
            a, b = index[ranks[i]], index[ranks[i + 1]]
            base = totals()
            base[a] -= (cum[ends[i]] - cum[lo]) / speed[a] / scale
            base[b] -= (cum[hi] - cum[ends[i]]) / speed[b] / scale
            candidates = np.arange(lo + 1, hi)  # every stage keeps at least one position
            ta = base[a] + (cum[candidates] - cum[lo]) / speed[a] / scale
            tb = base[b] + (cum[hi] - cum[candidates]) / speed[b] / scale
            rest = np.delete(base, [a, b])
            worst = np.maximum(np.maximum(ta, tb), rest.max() if rest.size else 0.0)
            squares = ta ** 2 + tb ** 2 + float((rest ** 2).sum())
            keys = list(zip(np.round(worst, 12).tolist(), squares.tolist()))
            best = min(range(len(candidates)), key=keys.__getitem__)
            current = key(totals())
            if keys[best] < current and keys[best][0] <= current[0]:
                ends[i] = int(candidates[best])
                moved = True
        if not moved:
            break
    return ends


def loop_rank_plan(graph: Graph, ranks: Sequence[int], speeds: Sequence[float]) -> Plan:
    """`len(ranks)` contiguous stages over one topological order, stage k on `ranks[k]` (a loop placement,
    `is_loop`), minimising the slowest rank's summed stage cost over its speed (`speeds`: one per stage, a rank's
    stages carry its speed). The optimizer's and the live rebalancer's loop plans. Nodes are graph by their
    `compute_ms` as given: an untimed graph is graph by the caller (`contiguous.priced_graph`, the policy's
    `with_cost_proxy`)."""
    if not is_loop(ranks):
        raise PlanError(f"a loop placement puts stage k on the rank of stage k % p over p >= 2 ranks with p*v stages "
                        f"(v >= 2); got ranks {list(ranks)[:12]}")
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
    ends = balance_cuts(states.compute, [part.end for part in solution.parts], [int(r) for r in ranks], by_rank)
    starts = [0] + ends[:-1]
    parts = tuple(Part(s, e, 1) for s, e in zip(starts, ends))
    costs = [float(states.compute[e - 1] - (states.compute[s - 1] if s else 0.0)) for s, e in zip(starts, ends)]
    solution = replace(solution, parts=parts, time_s=max(rank_times(costs, ranks, by_rank).values()))
    # No clock here (test_tuning: the optimizer never reads it); the plan's optimizer_seconds stays 0.
    plan = build_plan(graph, hierarchy, options, solution, assign_nodes(graph, work, solution), 0.0)
    return replace(plan, stages=tuple(replace(s, ranks=(int(ranks[i]),)) for i, s in enumerate(plan.stages)))
