"""Lower bounds for plans the exact DP cannot prove optimal, so they can say how far from optimal
they may be: the outermost level solved exactly with every machine of it running any range at
perfect balance (`relaxed_lower_bound`, below), and what single nodes and their weights' all-reduce
force (`node_share_bound`).

Inside one machine of the outermost level (a group of W workers: the product of the inner levels'
machine counts), any plan of a range (i, j] has stages whose worker counts add up to at most W, and
each stage takes at least its compute over its workers (replicas at every level divide, all-reduce
and transfers only add): so the inner best time of the range is at least `(C(j) - C(i)) / W`. Keep
the outermost level's own terms exact (replicas r <= M, all-reduce `4 (r-1) P / (B r) / M_inner`,
transfers `2 O / (B r) / R` at its boundaries, PipeDream's DP in FORMATS.md) and credit each range
with that floor: every real plan is a plan of this relaxation taking no longer, so the relaxation's
optimum is a time no plan beats.

Its decision version for a time T is a shortest path: `f(j)` = the fewest outer machines covering
the states up to j, `f(j) = min over ancestors i of f(i) + r(i, j)` with r the fewest replicas that
run stage (i, j] within T. The all-reduce term can make a replica count feasible while a smaller
one is not (and not the reverse): counting every r from the smallest feasible one only relaxes
further. Feasible when `f(last) <= M`. Only states that can bound an outer stage of a plan taking T
(`bounds.boundary_states` with groups of W) are visited, so the checks near the answer are small.
Bisection on T between `C_total / N` and the known plan's time gives the largest T proven
infeasible, to a relative tolerance, within a work budget (a check too costly for what is left is
skipped as if feasible: the bound only gets weaker, never wrong).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.search.bounds import ROUNDING, boundary_states
from model_parallel.optimizer.share_bound import node_share_bound  # noqa: F401 - its old home; tests import it here
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.states import CutCosts

_BLOCK = 256


def relaxed_lower_bound(
    costs: CutCosts, hierarchy: Hierarchy, options: PartitionOptions, upper_bound: float,
    tolerance: float = 1e-3, budget: Optional[float] = None,
) -> float:
    """A time no plan over the cuts of `costs` beats (module doc), at least `C_total / N`: the largest
    time the bisection proves infeasible, within `tolerance` (relative) of the relaxation's optimum
    unless a check would exceed what is left of `budget` (pairs of states; then it counts as feasible).
    `upper_bound` is the time of a known plan; `costs` must hold the state with every node (the
    largest) and be sorted by size (`cut_costs`)."""
    budget = options.tuning.relaxation_budget if budget is None else budget
    lower = float(costs.compute[-1]) / hierarchy.num_workers
    high = upper_bound
    while high - lower > tolerance * lower:
        middle = (lower + high) / 2
        chosen = outer_states(costs, hierarchy, options, middle)
        work = len(chosen) ** 2 / 2
        if work <= budget:
            budget -= work
            if not covers(costs, hierarchy, options, middle, chosen):
                lower = middle  # proven: no plan takes middle or less
                continue
        high = middle  # feasible, or too costly to tell
    return lower


def outer_states(costs: CutCosts, hierarchy: Hierarchy, options: PartitionOptions, time_s: float) -> np.ndarray:
    """Indices of the states that can bound an outermost stage of a plan taking `time_s` (and the last)."""
    outer = hierarchy.levels[-1]
    group = hierarchy.num_workers // outer.num_machines
    keep = boundary_states(costs.compute, float(costs.compute[-1]), hierarchy.num_workers, group, time_s)
    ratio = options.activation_compression_ratio
    if ratio is not None:  # the stage after a split has at most M - 1 machines
        keep &= costs.output <= time_s * (1.0 + ROUNDING) * outer.bandwidth * (outer.num_machines - 1) * ratio / 2
    keep[-1] = True
    return np.flatnonzero(keep)


def covers(
    costs: CutCosts, hierarchy: Hierarchy, options: PartitionOptions, time_s: float, chosen: Optional[np.ndarray] = None,
) -> bool:
    """Whether the relaxation has a plan taking at most `time_s` (a little generous: ROUNDING), over
    the states `chosen` (default `outer_states`: the others bound no stage of such a plan)."""
    levels = hierarchy.levels
    machines, bandwidth = levels[-1].num_machines, levels[-1].bandwidth
    group = hierarchy.num_workers // machines
    within = levels[-2].num_machines if len(levels) > 1 else 1
    ratio = options.activation_compression_ratio
    limit = time_s * (1.0 + ROUNDING)
    if chosen is None:
        chosen = outer_states(costs, hierarchy, options, time_s)
    compute = costs.compute[chosen] / group
    allreduce = 4 * costs.parameters[chosen] / (bandwidth * within)  # times (r-1)/r^2 for r replicas
    transfer = np.zeros(len(chosen)) if ratio is None else 2 * costs.output[chosen] / (bandwidth * ratio)
    members = costs.matrix[chosen].astype(np.float32)
    outside = (~costs.matrix[chosen]).astype(np.float32)
    last = len(chosen) - 1
    fewest = np.full(len(chosen), math.inf)  # outer machines covering the states up to j

    def replicas(work: np.ndarray, reduce: np.ndarray, moved: np.ndarray) -> np.ndarray:
        return fewest_replicas(work, reduce, moved, limit, machines, options.straight_pipeline)

    for start in range(0, len(chosen), _BLOCK):
        block = np.arange(start, min(len(chosen), start + _BLOCK))
        sends = np.where(block < last, transfer[block], 0.0)
        # The first stage (from the beginning): PipeDream counts no transfer on it.
        best = replicas(compute[block], allreduce[block], np.zeros(len(block)))
        # Ancestors i of j: no member of i outside j. States are sorted by size, so only columns i < j
        # are read below (the diagonal, j inside itself, never is).
        ancestors = (outside[block] @ members[: block[-1]].T) == 0  # [j, i]
        if start:
            earlier = replicas(
                compute[block, None] - compute[None, :start], allreduce[block, None] - allreduce[None, :start],
                np.maximum(transfer[None, :start], sends[:, None]),
            ) + fewest[None, :start]
            best = np.minimum(best, np.where(ancestors[:, :start], earlier, math.inf).min(axis=1))
        for row, j in enumerate(block):  # ancestors inside the block: their counts are settled in order
            inside = np.flatnonzero(ancestors[row, start:j]) + start
            if inside.size:
                candidates = fewest[inside] + replicas(
                    compute[j] - compute[inside], allreduce[j] - allreduce[inside],
                    np.maximum(transfer[inside], sends[row]),
                )
                best[row] = min(best[row], float(candidates.min()))
            fewest[j] = best[row]
    return bool(fewest[last] <= machines)


def fewest_replicas(
    work: np.ndarray, reduce: np.ndarray, moved: np.ndarray, limit: float, most: int, straight_pipeline: bool = False,
) -> np.ndarray:
    """Fewest replicas r with `work / r + reduce (r-1) / r^2 <= limit` and `moved / r <= limit`, as floats
    (inf above `most`, or above 1 for a straight pipeline): the first holds from the larger root of
    `limit r^2 - (work + reduce) r + reduce` on (or at r = 1). PipeDream's stage time on r replicas is
    `(work + 4 (r-1) P / (B r) / M_inside) / r`, so `reduce = 4 P / (B M_inside)`."""
    total = work + reduce
    root = (total + np.sqrt(np.maximum(total * total - 4 * limit * reduce, 0.0))) / (2 * limit)
    count = np.where(work <= limit, 1.0, np.ceil(root * (1 - ROUNDING)))
    count = np.maximum(count, np.maximum(np.ceil(moved / limit * (1 - ROUNDING)), 1.0))
    if straight_pipeline:
        count = np.where(count > 1, math.inf, count)
    return np.where(count <= most, count, math.inf)
