"""`node_share_bound`: a time no plan beats because of single nodes and their weights' all-reduce.

The core's lower bound for a plan it cannot prove optimal (`partition` sets `lower_bound_s` from it);
the search layers (`optimizer/search/relaxation.py`) add tighter ones.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from model_parallel.graph.hierarchy import Hierarchy

# Relative slack on a time: the DP sums and divides in another order than the bound's tests.
ROUNDING = 1e-9


def node_share_bound(
    compute: np.ndarray, parameters: np.ndarray, hierarchy: Hierarchy, straight_pipeline: bool = False,
    tolerance: float = 1e-4,
) -> float:
    """A time no plan beats because of single nodes and their weights' all-reduce, to `tolerance`.

    A stage replicated r_l times at each level l (w = the product of them workers) takes at least
    `C / w + a(P, r)`: PipeDream's nested all-reduce terms, `a = sum over l of 4 (r_l - 1) P /
    (B_l r_l M_{l-1}) / (r_l ... r_outermost)` (M_{-1} = 1), larger for more weights P. So at time T
    a node of compute c and weights p takes at least `c / (T - a(p, r))` of its stage's workers, for
    the cheapest r under which it would fit alone (`c / T` unreplicated, when c <= T); all nodes
    together take at most the N workers. Strong where weights make replication costly (inception_v3
    on 1024 workers), perfect balance elsewhere. Bisection on log T."""
    levels = hierarchy.levels
    counts = [range(1, 2 if straight_pipeline else level.num_machines + 1) for level in levels]
    workers, coefficients = [], []
    for replicas in itertools.product(*counts):
        coefficient, within = 0.0, 1
        for number, (level, r) in enumerate(zip(levels, replicas)):
            coefficient += 4 * (r - 1) / (level.bandwidth * r * within) / math.prod(replicas[number:])
            within = level.num_machines
        workers.append(math.prod(replicas))
        coefficients.append(coefficient)
    share_workers = np.array(workers, dtype=np.float64)[None, :]
    allreduce = parameters[:, None] * np.array(coefficients)[None, :]  # [node, replica counts]

    def fits(time_s: float) -> bool:  # a little generous (ROUNDING), like `covers`
        limit = time_s * (1.0 + ROUNDING)
        alone = (compute[:, None] / share_workers + allreduce <= limit) & (allreduce < limit)
        shares = np.where(alone, compute[:, None] / np.maximum(limit - allreduce, 1e-300), math.inf)
        return float(shares.min(axis=1).sum()) <= hierarchy.num_workers

    # At T = C_total every node fits unreplicated on one worker: the answer lies in between.
    lower, high = float(compute.sum()) / hierarchy.num_workers, float(compute.sum())
    if lower <= 0 or fits(lower):
        return max(lower, 0.0)
    while high > lower * (1 + tolerance):
        middle = math.sqrt(lower * high)
        if fits(middle):
            high = middle
        else:
            lower = middle
    return lower
