"""Exhaustive search over every partition of a small graph, under the same cost model as the DP (one level).

The oracle for the optimality tests and the benchmark's optimality gap. A partition is a chain of
cuts `{} < D1 < ... < Dq = all nodes` plus a replica count per stage (sum = M, or <= M with
`use_fewer_machines`). Stage i over `D_i - D_{i-1}` on r machines costs, as in PipeDream:

    max((T + 4 (r-1) W / (B r)) / r,  2 O(D_{i-1}) / (B r R) [i > 1],  2 O(D_i) / (B r R) [1 < i < q])

(the first stage never counts transfers, the last no output), and with a memory limit a stage whose
`stash_factor * (A + W)` exceeds it is not allowed.

- `all_cuts(work)`: every downward-closed node set, found by testing all 2^n subsets (independent of
  `states.ideal_states`), with the bytes that really cross it.
- `chains_of(states)`: a state space's own cuts and successor relation (PipeDream's antichain DAG:
  the DP may only go from state k to j when k is an ancestor of j).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from model_parallel.optimizer.costs import stash_factor
from model_parallel.optimizer.states import States, Workload, crossing_bytes


@dataclass(frozen=True)
class Cut:
    """A downward-closed node set (bitset) with its cumulative sums and the bytes crossing it."""

    mask: int
    compute: float
    activation: float
    parameters: float
    output: float


def all_cuts(work: Workload) -> tuple[list[Cut], list[list[int]]]:
    """Every non-empty downward-closed set (by brute force over subsets) and, per cut, its proper supersets."""
    n = work.num_nodes
    if n > 16:
        raise ValueError(f"brute force over 2^{n} subsets is too slow; use graphs of at most 16 nodes")
    pred_masks = [sum(1 << p for p in work.pred[v]) for v in range(n)]
    cuts = []
    for mask in range(1, 1 << n):
        if all(pred_masks[v] & ~mask == 0 for v in range(n) if (mask >> v) & 1):
            members = [v for v in range(n) if (mask >> v) & 1]
            cuts.append(Cut(mask, sum(work.compute_s[v] for v in members), sum(work.activation[v] for v in members),
                            sum(work.parameters[v] for v in members), crossing_bytes(work, mask)))
    following = [[j for j, b in enumerate(cuts) if b.mask != a.mask and a.mask & ~b.mask == 0] for a in cuts]
    return cuts, following


def chains_of(states: States) -> tuple[list[Cut], list[list[int]]]:
    """A state space as cuts, with k -> j allowed exactly when the DP allows it (k an ancestor of j)."""
    cuts = [Cut(states.members[s], float(states.compute[s]), float(states.activation[s]), float(states.parameters[s]),
                float(states.output[s])) for s in range(states.num_states)]
    following = [[j for j in range(states.num_states) if states.pred_mask[j, k]] for k in range(states.num_states)]
    return cuts, following


def brute_force(
    cuts: Sequence[Cut],
    following: Sequence[Sequence[int]],
    num_machines: int,
    bandwidth: float = 1e9,
    activation_compression_ratio: Optional[float] = None,
    straight_pipeline: bool = False,
    use_fewer_machines: bool = False,
    memory_limit: Optional[float] = None,
    memory_model: str = "pipedream",
    worker_speeds: Optional[Sequence[float]] = None,
) -> tuple[float, tuple[tuple[int, int], ...]]:
    """Best slowest-stage time over every chain of cuts ending at the full cut, and that chain.

    Returns `(time, ((cut index, replicas), ...))`; `(inf, ())` when nothing is feasible. With
    `worker_speeds` stages take workers in order and divide their work by r times the slowest speed.
    """
    full = max(range(len(cuts)), key=lambda i: bin(cuts[i].mask).count("1"))
    ratio = activation_compression_ratio
    big_m = num_machines

    def stage_time(prev: Optional[Cut], cut: Cut, r: int, used_before: int, index: int, last: bool) -> float:
        t = cut.compute - (prev.compute if prev else 0.0)
        w = cut.parameters - (prev.parameters if prev else 0.0)
        a = cut.activation - (prev.activation if prev else 0.0)
        if memory_limit is not None and stash_factor(memory_model, big_m, used_before, r) * (a + w) > memory_limit:
            return math.inf
        share = r if worker_speeds is None else r * min(worker_speeds[used_before:used_before + r])
        time = (t + (4 * (r - 1) * w) / (bandwidth * r)) / share
        if ratio is not None and prev is not None:
            time = max(time, (2.0 * prev.output) / (bandwidth * r) / ratio)
            if not last:
                time = max(time, (2.0 * cut.output) / (bandwidth * r) / ratio)
        return time

    @lru_cache(maxsize=None)
    def best_from(prev_index: int, used: int, stage_index: int) -> tuple[float, tuple[tuple[int, int], ...]]:
        prev = cuts[prev_index] if prev_index >= 0 else None
        nexts = following[prev_index] if prev_index >= 0 else range(len(cuts))
        result: tuple[float, tuple[tuple[int, int], ...]] = (math.inf, ())
        for j in nexts:
            last = j == full
            for r in range(1, (1 if straight_pipeline else big_m - used) + 1):
                if used + r > big_m:
                    break
                time = stage_time(prev, cuts[j], r, used, stage_index, last)
                if time >= result[0]:
                    continue
                if last:
                    if use_fewer_machines or used + r == big_m:
                        result = (time, ((j, r),))
                    continue
                rest, chain = best_from(j, used + r, stage_index + 1)
                total = max(time, rest)
                if total < result[0]:
                    result = (total, ((j, r), *chain))
        return result

    return best_from(-1, 0, 0)
