"""Exact plans of one machine's own workers for the ranges that start at chosen states (three levels).

The flattened relaxation (`flattened.py`) credits a next-level machine (a server) with perfect balance
over its workers (GPUs), or with lower bounds on a chain of them. That is what keeps its bound below the
optimum: a range of ~100 nodes does not split evenly over 8 GPUs (on the 1000-node graph the best chain
of a server that runs its pod's first stage is 0.5-0.9% slower than perfect balance). The exact time of
such a range is a row of the innermost level's DP, PipeDream's `A[start][j][m]` for every end `j` at once:
too costly for every start (cubic), cheap for the few starts a relaxed plan actually uses.

So the search refines lazily (`partition.flat_search`): the relaxation's plan at a time T names the
starts of its next-level stages; their rows are computed here, and the pass runs again with them,
charging every stage from those starts its exact time. Either no plan of the relaxation fits any more
(a proof that nothing takes T or less) or the plan it finds only uses exact stages: a real plan (its
inner cuts come from the rows' back-pointers).

A row follows PipeDream's innermost rules (FORMATS.md, as the chains of `flattened.py`): a stage on r of the
machine's G workers takes `compute / r + 4 P (r-1) / (B r^2)`; the first of the chain counts no
transfers, the others `2 O / (B r)` in and out (out unless the cut is the whole graph). "At most G
workers" (the minimum over fewer): a plan of the DP on exactly G is one of these, so the time is a lower
bound for it, and it is a real plan itself (idle workers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from model_parallel.graph.hierarchy import Level
from model_parallel.optimizer.search.flat_kernel import FlatStates, included, level_transfers
from model_parallel.optimizer.search.jit import njit
from model_parallel.optimizer.options import PartitionOptions


@dataclass(frozen=True)
class InnerRow:
    """Least times of the ranges (start, end] on at most 1..G workers, for the ends up to `reach` compute
    after the start."""

    start: int  # -1: the beginning of the graph
    reach: float
    ends: np.ndarray  # state indices, ascending (each contains the start)
    times: np.ndarray  # [end, m]: least time on at most m workers
    inside: np.ndarray  # [later end, earlier end]: the earlier one lies strictly inside


class InnerRows:
    """Rows of the innermost level's DP, computed on demand and kept across passes (their times do not
    depend on the pass's time)."""

    def __init__(self, states: FlatStates, level: Level, options: PartitionOptions, most_compute: float) -> None:
        self.states, self.most_compute = states, most_compute
        self.workers, self.straight = level.num_machines, options.straight_pipeline
        self.reduce = 4 / level.bandwidth
        self.send, self.out = level_transfers(states.output, level, options)
        self.rows: dict[int, InnerRow] = {}
        self._row_of = np.full(states.num_states + 1, -1, dtype=np.int64)  # [start + 1]: its row in `_times`
        self._dense: list[np.ndarray] = []  # per row: [state] time on all G workers, nan where not computed
        self._times: Optional[np.ndarray] = None  # `_dense` stacked, until a row changes
        self.added: list[int] = []  # the start of every row computed (or widened), in order
        self.pairs = 0  # (end, split) pairs computed so far: the work done
        g = np.arange(1, self.workers + 1, dtype=float)
        self._per_worker, self._reduce_per_worker = 1 / g, self.reduce * (g - 1) / g ** 2  # a stage on g workers
        # A straight pipeline runs one worker per stage: a stage on more is not allowed.
        self._allowed = np.where((g == 1) | (not options.straight_pipeline), 0.0, math.inf)
        counts = range(1, self.workers + 1)
        # Every (m, m') with m' < m: the last stage on m' workers after a part on m - m', grouped by m.
        self._before = np.array([m - last - 1 for m in counts for last in range(1, m)], dtype=int)
        self._last = np.array([last - 1 for m in counts for last in range(1, m)], dtype=int)
        self._group = np.array([m for m in counts for _ in range(1, m)], dtype=int)
        self._group_starts = np.flatnonzero(np.r_[True, self._group[1:] != self._group[:-1]])

    def covers(self, start: int, end: int) -> bool:
        row = self._row_of[start + 1]
        return bool(row >= 0 and not math.isnan(self._dense[row][end]))

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """For the pass (`flat_kernel.flat_pass`): per start + 1 its row (-1: none), and the rows' times
        [row, state] on all G workers (nan where a row does not reach)."""
        if self._times is None:
            self._times = np.stack(self._dense) if self._dense else np.empty((0, self.states.num_states))
        return self._row_of, self._times

    def add(self, start: int, reach: float) -> None:
        """Compute (or widen) the row of `start` to ends up to `reach` compute after it."""
        reach = min(reach, self.most_compute)
        if start in self.rows and self.rows[start].reach >= reach:
            return
        row = self._row(start, reach)
        self.rows[start] = row
        dense = np.full(self.states.num_states, math.nan)
        dense[row.ends] = row.times[:, -1]
        if self._row_of[start + 1] < 0:
            self._row_of[start + 1] = len(self._dense)
            self._dense.append(dense)
        else:
            self._dense[self._row_of[start + 1]] = dense
        self._times = None
        self.added.append(start)

    def inner_cuts(self, start: int, end: int) -> list[int]:
        """The states ending the stages of the optimum of (start, end] before `end`: the row's choices
        recomputed along the optimum's path only."""
        row, cuts = self.rows[start], []
        at, m = int(np.searchsorted(row.ends, end)), self.workers
        while True:
            m = int(np.argmax(row.times[at] <= row.times[at, m - 1])) + 1  # the fewest workers with the least time
            one, splits, values = self._choices(row, at)
            if one[m - 1] <= row.times[at, m - 1] or not splits.size:
                return sorted(cuts)
            group = np.flatnonzero(self._group == m)
            k, pair = np.unravel_index(int(values[:, group].argmin()), (len(splits), len(group)))
            cuts.append(int(row.ends[splits[k]]))
            at, m = int(splits[k]), int(self._before[group[pair]]) + 1

    def _choices(self, row: InnerRow, at: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the end at position `at`: one stage from the start on 1..G workers, the splits (positions),
        and the time of each (split, (m, m')) choice."""
        compute, parameters = self.states.compute, self.states.parameters
        end = int(row.ends[at])
        c_start = compute[row.start] if row.start >= 0 else 0.0
        w_start = parameters[row.start] if row.start >= 0 else 0.0
        one = (compute[end] - c_start) * self._per_worker + (parameters[end] - w_start) * self._reduce_per_worker + self._allowed
        splits = np.flatnonzero(row.inside[at, :at])
        k = row.ends[splits]
        stage = (compute[end] - compute[k])[:, None] * self._per_worker
        stage += (parameters[end] - parameters[k])[:, None] * self._reduce_per_worker
        np.maximum(stage, np.maximum(self.send[k], self.out[end])[:, None] * self._per_worker, out=stage)
        stage += self._allowed
        values = row.times[splits][:, self._before]
        return one, splits, np.maximum(values, stage[:, self._last], out=values)

    def _row(self, start: int, reach: float) -> InnerRow:
        compute = self.states.compute
        c_start = compute[start] if start >= 0 else 0.0
        ends = np.flatnonzero((compute > c_start) & (compute - c_start <= reach * (1 + 1e-9)))
        if start >= 0:
            ends = ends[included(self.states.inclusion, ends, np.full(len(ends), start))]
        inside = included(self.states.inclusion, ends[:, None], ends[None, :])  # strictly: only earlier ends
        row = InnerRow(start, reach, ends, np.empty((len(ends), self.workers)), inside)
        _row_times(ends, inside, self.states.compute, self.states.parameters, c_start,
                   self.states.parameters[start] if start >= 0 else 0.0, self._per_worker, self._reduce_per_worker,
                   self._allowed, self.send, self.out, row.times)
        if self.workers > 1:
            self.pairs += int(np.count_nonzero(inside))
        return row


@njit(cache=True)
def _row_times(ends: np.ndarray, inside: np.ndarray, compute: np.ndarray, parameters: np.ndarray, c_start: float,
               w_start: float, per_worker: np.ndarray, reduce_per_worker: np.ndarray, allowed: np.ndarray,
               send: np.ndarray, out: np.ndarray, times: np.ndarray) -> None:
    """Fill `times` [end, m - 1] of a row (`InnerRows._row`), ends in order: what `InnerRows._choices` gives
    each end, compiled (its terms in the same floating-point order, so `inner_cuts` retraces it)."""
    workers = len(per_worker)
    best, stage = np.empty(workers), np.empty(workers)
    for at in range(len(ends)):
        end = ends[at]
        for g in range(workers):  # one stage from the start on g + 1 workers
            best[g] = (compute[end] - c_start) * per_worker[g] + (parameters[end] - w_start) * reduce_per_worker[g] + allowed[g]
        for split in range(at if workers > 1 else 0):
            if not inside[at, split]:
                continue
            k = ends[split]
            moved = max(send[k], out[end])
            for g in range(workers):  # the last stage (k, end] on g + 1 workers
                time = (compute[end] - compute[k]) * per_worker[g]
                time += (parameters[end] - parameters[k]) * reduce_per_worker[g]
                stage[g] = max(time, moved * per_worker[g]) + allowed[g]
            for m in range(1, workers):  # m + 1 workers in all: the last stage on last + 1, the part before on the rest
                for last in range(m):
                    value = max(times[split, m - last - 1], stage[last])
                    if value < best[m]:
                        best[m] = value
        times[at, 0] = best[0]
        for m in range(1, workers):  # at most m + 1 workers
            times[at, m] = min(times[at, m - 1], best[m])
