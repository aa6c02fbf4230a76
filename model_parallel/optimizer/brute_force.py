"""Exhaustive search over every partition of a small graph, under the same cost model as the DP.

The oracle for the optimality tests and the benchmark's optimality gap. A partition is a chain of
cuts `{} < D1 < ... < Dq = all nodes` plus a replica count per stage (sum = M, or <= M with
`use_fewer_machines`). Stage i over `D_i - D_{i-1}` on r machines costs, as in PipeDream:

    max((T + 4 (r-1) W / (B r)) / r,  2 O(D_{i-1}) / (B r R) [i > 1],  2 O(D_i) / (B r R) [1 < i < q])

(the first stage never counts transfers, the last no output), and with a memory limit a stage whose
`memory.stage_bytes` (e.g. `f * (A + W)`) exceeds it is not allowed. On a hierarchy (`brute_force_hierarchy`) T is the
range's best time one level down, and the first stage's all-reduce divides by that level's machines.

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
from typing import Any, Optional

from model_parallel.optimizer.costs import allreduce_seconds, transfer_seconds
from model_parallel.optimizer.memory import MemoryModel, multipliers, stage_bytes
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
    *options: Any,
    **named: Any,
) -> tuple[float, tuple[tuple[int, int], ...]]:
    """One level: `brute_force_hierarchy` with `[num_machines]` and `[bandwidth]` (same options after them)."""
    return brute_force_hierarchy(cuts, following, [num_machines], [bandwidth], *options, **named)


def brute_force_hierarchy(
    cuts: Sequence[Cut],
    following: Sequence[Sequence[int]],
    machines: Sequence[int],
    bandwidths: Sequence[float],
    activation_compression_ratio: Optional[float] = None,
    straight_pipeline: bool = False,
    use_fewer_machines: bool = False,
    memory_limit: Optional[float] = None,
    memory_model: MemoryModel = "pipedream",
    worker_speeds: Optional[Sequence[float]] = None,
) -> tuple[float, tuple[tuple[int, int], ...]]:
    """Best slowest-stage time over every chain of cuts ending at the full cut, and the outermost level's
    chain `((cut index, replicas), ...)`; `(inf, ())` when nothing is feasible.

    PipeDream's hierarchical model (FORMATS.md steps 3-4) by exhaustive search, written from the text
    and independent of `dp.py`: level l splits a range over its M_l machines into a chain of stages; a
    stage's compute is level l-1's best for that range on all M_{l-1} machines (level 0: the range's
    compute). The first stage of a chain is PipeDream's "single stage": its all-reduce divides by the
    machine count g of the level inside and it counts no transfers; later stages count their input
    and output (the latter unless the cut is the whole graph).

    `worker_speeds` (rank order, innermost level fastest): at level 0 a stage's work divides by r times
    its slowest worker; above, a stage on machines a..b runs the inner plan at the elementwise slowest
    profile of those machines (replicas run the same inner plan, dealt microbatches round-robin).
    """
    full = max(range(len(cuts)), key=lambda i: bin(cuts[i].mask).count("1"))
    ratio = activation_compression_ratio
    shape = [int(m) for m in reversed(machines)]
    speeds = None if worker_speeds is None else _nested(list(worker_speeds), shape)

    @lru_cache(maxsize=None)
    def best(level: int, start: int, end: int, block: Any) -> tuple[float, tuple[tuple[int, int], ...]]:
        big_m = machines[level]
        bandwidth = bandwidths[level]
        within = machines[level - 1] if level else 1

        def stage_time(prev: int, cut: int, r: int, used_before: int) -> float:
            a = cuts[prev] if prev >= 0 else None
            b = cuts[cut]
            w = b.parameters - (a.parameters if a else 0.0)
            act = b.activation - (a.activation if a else 0.0)
            factors = multipliers(memory_model, big_m, used_before, r) if memory_limit is not None else (0, 0)
            if memory_limit is not None and stage_bytes(factors, act, w) > memory_limit:
                return math.inf
            window = None if block is None else block[used_before:used_before + r]
            if level == 0:
                work = b.compute - (a.compute if a else 0.0)
                share = r if window is None else r * min(window)
            else:
                inner = None if window is None else tuple(map(_slowest, zip(*window)))
                work, share = best(level - 1, prev, cut, inner)[0], r
            first = prev == start
            allreduce = allreduce_seconds(w, r, bandwidth, within if first else 1)
            time = (work + allreduce) / share
            if ratio is not None and not first:
                time = max(time, transfer_seconds(a.output, bandwidth, r, ratio))
                if cut != full:
                    time = max(time, transfer_seconds(b.output, bandwidth, r, ratio))
            return time

        @lru_cache(maxsize=None)
        def chain(prev: int, used: int) -> tuple[float, tuple[tuple[int, int], ...]]:
            result: tuple[float, tuple[tuple[int, int], ...]] = (math.inf, ())
            nexts = following[prev] if prev >= 0 else range(len(cuts))
            for j in nexts:
                if not (j == end or end in following[j]):
                    continue
                for r in range(1, (1 if straight_pipeline else big_m - used) + 1):
                    if used + r > big_m:
                        break
                    time = stage_time(prev, j, r, used)
                    if time >= result[0]:
                        continue
                    if j == end:
                        if use_fewer_machines or used + r == big_m:
                            result = (time, ((j, r),))
                        continue
                    rest, tail = chain(j, used + r)
                    if max(time, rest) < result[0]:
                        result = (max(time, rest), ((j, r), *tail))
            return result

        return chain(start, 0)

    return best(len(machines) - 1, -1, full, speeds)


def _nested(values: list[float], shape: list[int]) -> Any:
    """`values` as nested tuples of `shape` (hashable, for the cache)."""
    if len(shape) == 1:
        return tuple(values)
    size = len(values) // shape[0]
    return tuple(_nested(values[i * size:(i + 1) * size], shape[1:]) for i in range(shape[0]))


def _slowest(blocks: tuple[Any, ...]) -> Any:
    """Elementwise minimum of equally shaped nested tuples."""
    if isinstance(blocks[0], tuple):
        return tuple(map(_slowest, zip(*blocks)))
    return min(blocks)
