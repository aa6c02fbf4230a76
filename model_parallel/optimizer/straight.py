"""The straight-pipeline fast path: p stages over prefixes of one topological order, stage k on worker k.

Exact for the bottleneck over that order: `best[t][j]` = the smallest possible slowest-stage time of
the first j+1 nodes cut into t+1 stages on workers 0..t, computed for all j at once per stage t as
a (k, j) matrix (O(p S^2) numpy work, milliseconds for S ~ 600). This is what the live rebalancer
calls on every re-plan with measured worker speeds.

    stage t on worker t over states k+1..j:
        time = max(best[t-1][k], (X(j) - X(k)) / speed_t, 2 O(k) / (B R), 2 O(j) / (B R) [j not last])

Many cuts often share the optimal bottleneck (one heavy stage, a Llama's embedding, sets it; the others
could be anything below it). A second pass of the same shape picks, among them, the cuts with the
smallest sum of squared stage times: the most even split that is still optimal (`balanced`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from model_parallel.optimizer.costs import transfer_seconds
from model_parallel.optimizer.dp import Part
from model_parallel.optimizer.memory import MemoryModel, multipliers, stage_bytes
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
    balanced: bool = True,
) -> tuple[float, list[Part]]:
    """Best bottleneck and its parts (inf and [] when infeasible, e.g. more workers than states); with
    `balanced`, the most even of the cuts that reach that bottleneck, else the earliest cuts."""
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

    def stage_times(t: int) -> np.ndarray:
        """[j, k]: stage t's time over states k+1..j (inf where it does not fit or cannot be cut)."""
        times = diff / speeds[t]
        if floor is not None:
            np.maximum(times, floor, out=times)
        if stash_diff is not None:
            times[~stash_ok(stash_diff, t)] = INF
        return times

    first = x / speeds[0]
    if memory_limit is not None:
        first = np.where(stash_ok(stash, 0), first, INF)
    best = np.full((p, s), INF)
    choice = np.full((p, s), -1, dtype=np.int64)
    best[0] = first
    rows = np.arange(s)
    for t in range(1, p):
        cand = np.maximum(stage_times(t), best[t - 1][None, :])
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
    if balanced and stages > 1:
        choice = _balanced_choice(first, stage_times, stages, value)
    parts: list[Part] = []
    j = s - 1
    for t in range(stages - 1, 0, -1):
        k = int(choice[t, j])
        parts.append(Part(k + 1, j + 1, 1))
        j = k
    parts.append(Part(0, j + 1, 1))
    return value, parts[::-1]


def _balanced_choice(first: np.ndarray, stage_times, stages: int, bottleneck: float) -> np.ndarray:
    """Cuts (as `choice[t, j]`) with the least sum of squared stage times among those whose every stage
    stays within `bottleneck` (one exists: the bottleneck was reached)."""
    bound = bottleneck * (1 + 1e-9) + 1e-300  # the first pass's own stages, up to rounding
    s = len(first)
    rows = np.arange(s)
    scale = bottleneck if bottleneck > 0 else 1.0  # squares of times near 1: no underflow
    squares = np.where(first <= bound, (first / scale) ** 2, INF)
    choice = np.full((stages, s), -1, dtype=np.int64)
    for t in range(1, stages):
        times = stage_times(t)
        with np.errstate(invalid="ignore"):
            cand = np.where(times <= bound, (times / scale) ** 2, INF) + squares[None, :]
        choice[t] = np.argmin(cand, axis=1)
        squares = cand[rows, choice[t]]
    return choice


def smallest_memory(states: States, stages: int, memory_model: MemoryModel) -> float:
    """The least bytes per worker that some `stages`-stage straight split over `states` needs, by the
    memory checks' own sums (the values a stage sends and receives are not in them)."""
    s = states.num_states
    if not 1 <= stages <= s:
        return INF
    lower = np.tri(s, s, -1, dtype=bool)

    def held(t: int, activation: np.ndarray, parameters: np.ndarray) -> np.ndarray:
        return stage_bytes(multipliers(memory_model, stages, t, 1), activation, parameters)

    best = held(0, states.activation, states.parameters)
    act = states.activation[:, None] - states.activation[None, :]
    par = states.parameters[:, None] - states.parameters[None, :]
    for t in range(1, stages):
        cand = np.where(lower, np.maximum(held(t, act, par), best[None, :]), INF)
        best = cand.min(axis=1)
    return float(best[-1])
