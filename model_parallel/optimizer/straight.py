"""The straight-pipeline fast path: p stages over prefixes of one topological order, stage k on worker k.

Exact for the bottleneck over that order: `best[t][j]` = the smallest possible slowest-stage time of
the first j+1 nodes cut into t+1 stages on workers 0..t, computed for all j at once per stage t as
a (k, j) matrix (O(p S^2) numpy work, milliseconds for S ~ 600). This is what the live rebalancer
calls on every re-plan with measured worker speeds.

    stage t on worker t over states k+1..j:
        time = max(best[t-1][k], (X(j) - X(k)) / speed_t, 2 O(k) / (B R), 2 O(j) / (B R) [j not last])
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from model_parallel.optimizer.costs import transfer_seconds
from model_parallel.optimizer.dp import Part
from model_parallel.optimizer.memory import MemoryModel, multipliers
from model_parallel.optimizer.states import States

INF = np.inf


def straight_partition(
    states: States,
    speeds: Sequence[float],
    bandwidth: float,
    activation_compression_ratio: Optional[float] = None,
    use_fewer_machines: bool = False,
    memory_limit: Optional[float] = None,
    memory_model: MemoryModel = "pipedream",
) -> tuple[float, list[Part]]:
    """Best bottleneck and its parts (inf and [] when infeasible, e.g. more workers than states)."""
    x = states.compute
    stash = states.activation + states.parameters
    s = len(x)
    p = len(speeds)
    ratio = activation_compression_ratio
    # Matrices are laid out [j, k] (k = the cut before the last stage, k < j) so that the min over k
    # runs along contiguous memory.
    lower = np.tri(s, s, -1, dtype=bool)
    diff = np.where(lower, x[:, None] - x[None, :], INF)
    floor = None  # per-(j, k) terms that do not depend on the stage: the transfers
    if ratio is not None:
        transfer = transfer_seconds(states.output, bandwidth, 1, ratio)
        outgoing = transfer.copy()
        outgoing[-1] = 0.0  # the last state sends nothing on
        floor = np.maximum(outgoing[:, None], transfer[None, :])
    legacy = isinstance(memory_model, str)
    if memory_limit is not None and not legacy:  # the footprint weighs activations and weights apart
        stash = np.stack([states.activation, states.parameters])
    stash_diff = np.where(lower, stash[..., :, None] - stash[..., None, :], INF) if memory_limit is not None else None

    def stash_ok(bytes_: np.ndarray, stage: int) -> np.ndarray:
        act, params = multipliers(memory_model, p, stage, 1)
        with np.errstate(invalid="ignore"):
            if legacy:  # PipeDream's f (A + W), summed before the difference as it always was
                return act * bytes_ <= memory_limit
            return act * bytes_[0] + params * bytes_[1] <= memory_limit

    best = np.full((p, s), INF)
    choice = np.full((p, s), -1, dtype=np.int64)
    best[0] = x / speeds[0]
    if memory_limit is not None:
        best[0] = np.where(stash_ok(stash, 0), best[0], INF)
    rows = np.arange(s)
    for t in range(1, p):
        cand = np.maximum(diff / speeds[t], best[t - 1][None, :])
        if floor is not None:
            np.maximum(cand, floor, out=cand)
        if stash_diff is not None:
            cand[~stash_ok(stash_diff, t)] = INF
        choice[t] = np.argmin(cand, axis=1)  # first minimum: earliest cut
        best[t] = cand[rows, choice[t]]
    stages = p
    if use_fewer_machines:
        # Fewer stages leave the last workers idle; ties prefer more stages (smaller stages migrate less).
        finals = best[:, s - 1]
        stages = int(p - np.argmin(finals[::-1]))
    value = float(best[stages - 1, s - 1])
    if not np.isfinite(value):
        return value, []
    parts: list[Part] = []
    j = s - 1
    for t in range(stages - 1, 0, -1):
        k = int(choice[t, j])
        parts.append(Part(k + 1, j + 1, 1))
        j = k
    parts.append(Part(0, j + 1, 1))
    return value, parts[::-1]
