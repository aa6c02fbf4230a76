"""The flattened pass (`flattened.py`) compiled with numba: a scalar loop over the pairs (start, end] a
pass reads, in blocks of states: the pairs from earlier blocks (settled states) in parallel over the
block's states, then the block's own pairs in order, each state settled before a later one reads it.

The numpy version it replaced built matrices of machine counts per block (and waves of states inside a
block): ~60 ns per pair, against ~10 ns here on 2 cores. The rules are those of the module doc of
`flattened.py`, term for term in the same floating-point order (the heuristic's data-parallel work is
its linear form), checked against that version on random problems when it was replaced.

Compiled on first use when numba is installed (`cache=True` keeps the machine code beside this file, in
__pycache__; ~15-25 s once per checkout); without numba the same loops run as plain Python (`jit.py`:
fine for the tests' small problems, far too slow for the 1000-node graphs). This module also holds the
data a pass reads (`FlatStates`, `level_transfers`, `included`), so that `inner_rows.py` and
`flattened.py` both import it and not each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
from model_parallel.graph.hierarchy import Level
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search.bounds import ROUNDING
from model_parallel.optimizer.search.jit import njit, prange


class Layout(NamedTuple):
    """Which pairs a pass reads (`flattened.FlatStates`): per block of states, its columns (earlier blocks'
    states, then its own) and a byte per (state, column) where the column lies strictly inside."""

    block_starts: np.ndarray
    column_offsets: np.ndarray
    columns: np.ndarray
    inside_offsets: np.ndarray
    inside: np.ndarray


class Costs(NamedTuple):
    """Per state: sums, and a stage's transfers over each level's links as its input (`*_send`) and output
    (`*_out`); the inclusion bits (chains); the exact inner rows: `row_of[start + 1]` >= 0 names the row of
    `row_times` [row, state] (nan where it does not reach) of the stages from that start."""

    compute: np.ndarray
    parameters: np.ndarray
    inner_send: np.ndarray
    inner_out: np.ndarray
    outer_send: np.ndarray
    outer_out: np.ndarray
    chain_send: np.ndarray
    chain_out: np.ndarray
    bits: np.ndarray
    row_of: np.ndarray
    row_times: np.ndarray


class Rules(NamedTuple):
    """The pass's scalars. A next-level stage's work is its compute over `workers_inside` (perfect balance),
    or with `data_parallel` PipeDream's data-parallel time on the levels inside (the heuristic; linear:
    `data_parallel_compute * C + data_parallel_weights * P`). `chains` holds a next-level machine to its own
    `chain_workers`, whose all-reduce coefficient is `chain_reduce` (three levels)."""

    limit: float
    outer_machines: int
    inner_machines: int
    workers_inside: float
    within_inner: float
    inner_bandwidth: float
    outer_bandwidth: float
    straight: bool
    replicated_outer: bool
    window: float
    most_replicated_weights: float
    data_parallel: bool
    data_parallel_compute: float
    data_parallel_weights: float
    chains: bool
    chain_workers: int
    chain_reduce: float


class Tables(NamedTuple):
    """The pass's tables (`flattened.py`'s module doc): where each entry came from, for the plan."""

    fewest_outer: np.ndarray  # P [state]
    fewest_inner: np.ndarray  # Q [state, p]
    open_from: np.ndarray  # [state]: the fewest p (outer machines before) an unreplicated outer stage starting after it has; M: none
    closed_at: np.ndarray  # [state]: p of the unreplicated outer stage that ends at the state (-1: none)
    source: np.ndarray  # [state, p]: the state the entry's last inner stage starts after (-1: the beginning)
    source_p: np.ndarray  # [state, p]: the entry it extends there (its p, or the p of the outer stage closed there)


class _Scratch(NamedTuple):
    """Per state of a block: the best entries so far (`best*` [row, p]), the fewest machines of a stage
    opening after a start per threshold open_from[start] (`opening*` [row, threshold]), and the replicated
    outer alternative [row]."""

    best: np.ndarray
    best_source: np.ndarray
    best_source_p: np.ndarray
    opening_best: np.ndarray
    opening_source: np.ndarray
    replicated: np.ndarray


@dataclass(frozen=True)
class FlatStates:
    """Cut states ordered by size (ancestors first; the last holds every node) and, per block of `_BLOCK`
    states, the earlier states a pass at up to `max_time_s` reads there (`layout.columns`: a band of earlier
    blocks' states, then the block's own) and which of them lie strictly inside each state of the block
    (`layout.inside`: a byte per (state, column), row by row)."""

    members: tuple[int, ...]
    compute: np.ndarray
    parameters: np.ndarray
    output: np.ndarray
    max_time_s: float
    layout: Layout
    # On three levels: bit (later, earlier) set where state `earlier` lies strictly inside `later`, for the
    # pairs the blocks read (np.packbits rows), so the relaxation can chain a machine's own workers.
    inclusion: Optional[np.ndarray] = None

    @property
    def num_states(self) -> int:
        return len(self.compute)

    @property
    def pairs(self) -> int:
        """Pairs of states a pass may visit (its cost)."""
        return len(self.layout.inside)


def level_transfers(output: np.ndarray, level: Level, options: PartitionOptions) -> tuple[np.ndarray, np.ndarray]:
    """Per state, a stage's transfer over the level's links of the activations crossing it (`2 O / (B R)`,
    zero when transfers are not counted) as its input, and as its output (none from the whole graph)."""
    ratio = options.activation_compression_ratio
    send = np.zeros(len(output)) if ratio is None else 2 * output / (level.bandwidth * ratio)
    return send, np.where(np.arange(len(output)) < len(output) - 1, send, 0.0)


def included(bits: np.ndarray, later: np.ndarray, earlier: np.ndarray) -> np.ndarray:
    """Whether `earlier` lies strictly inside `later` (elementwise, broadcast) in packed inclusion bits."""
    return ((bits[later, earlier >> 3] >> (7 - (earlier & 7))) & 1).astype(bool)


@njit(cache=True, inline="always")
def fewest_replicas(work: float, reduce: float, moved: float, limit: float, most: int, straight: bool) -> float:
    """`relaxation.fewest_replicas` for one stage, as a float (inf: none of at most `most` fits)."""
    if work <= limit:
        count = 1.0
    else:
        total = work + reduce
        root = (total + math.sqrt(max(total * total - 4 * limit * reduce, 0.0))) / (2 * limit)
        count = np.ceil(root * (1 - ROUNDING))
    count = max(count, max(np.ceil(moved / limit * (1 - ROUNDING)), 1.0))
    if straight and count > 1:
        return math.inf
    return count if count <= most else math.inf


@njit(cache=True, inline="always")
def _inside(bits: np.ndarray, later: int, earlier: int) -> bool:
    """Whether state `earlier` lies strictly inside `later` (`flattened.included`, one pair)."""
    return (bits[later, earlier >> 3] >> (7 - (earlier & 7))) & 1 == 1


@njit(cache=True)
def _chain_fits(start: int, end: int, costs: Costs, rules: Rules) -> bool:
    """Whether one next-level machine's `chain_workers` may run (start, end] as a stage of one replica: one
    stage on them, or a chain through some split k by its two lower bounds (the module doc of `flattened.py`)."""
    compute, parameters, limit, straight = costs.compute, costs.parameters, rules.limit, rules.straight
    workers, reduce = rules.chain_workers, rules.chain_reduce
    c_start = compute[start] if start >= 0 else 0.0
    w_start = parameters[start] if start >= 0 else 0.0
    c_end, w_end = compute[end], parameters[end]
    if fewest_replicas(c_end - c_start, reduce * (w_end - w_start), 0.0, limit, workers, straight) <= workers:
        return True
    by_last, by_first = math.inf, math.inf
    reach = workers * limit * (1 + 1e-9)
    # Splits strictly inside the end and holding the start: states ordered by size, so between the two.
    for k in range(end - 1, start, -1):
        if (c_end - compute[k] > reach or not _inside(costs.bits, end, k)
                or (start >= 0 and not _inside(costs.bits, k, start))):
            continue
        before, after = compute[k] - c_start, c_end - compute[k]
        moved = max(costs.chain_send[k], costs.chain_out[end])
        last = fewest_replicas(after, reduce * (w_end - parameters[k]), moved, limit, workers, straight)
        first = fewest_replicas(before, reduce * (parameters[k] - w_start), 0.0, limit, workers, straight)
        by_last = min(by_last, max(np.ceil(before / limit * (1 - ROUNDING)), 1.0) + last)
        by_first = min(by_first, first + max(np.ceil(after / limit * (1 - ROUNDING)), 1.0))
        if by_last <= workers and by_first <= workers:
            return True
    return max(by_last, by_first) <= workers


@njit(cache=True, parallel=True)
def flat_pass(layout: Layout, costs: Costs, rules: Rules, resume_from: int, tables: Tables) -> None:
    """Fill `tables` at `rules.limit`, keeping the entries of the states before `resume_from` as given (a
    pass whose counts only changed for stages after that state, from new rows, resumes there). Per block,
    the stages from earlier blocks (settled) are offered to its states in parallel, then those from the
    block's own states in order, each state settled before a later one reads it."""
    machines, most = rules.outer_machines, int(np.max(np.diff(layout.block_starts)))
    scratch = _Scratch(np.empty((most, machines)), np.empty((most, machines), dtype=np.int64),
                       np.empty((most, machines), dtype=np.int64), np.empty((most, machines)),
                       np.empty((most, machines), dtype=np.int64), np.empty(most))
    tables.fewest_outer[resume_from:], tables.fewest_inner[resume_from:, :] = math.inf, math.inf
    tables.open_from[resume_from:], tables.closed_at[resume_from:] = machines, -1
    tables.source[resume_from:, :], tables.source_p[resume_from:, :] = -1, 0
    for block in range(len(layout.block_starts) - 1):
        begin, size = layout.block_starts[block], layout.block_starts[block + 1] - layout.block_starts[block]
        width = layout.column_offsets[block + 1] - layout.column_offsets[block]
        first_row = max(resume_from - begin, 0)
        for row in prange(first_row, size):
            _begin(row, begin + row, costs, rules, scratch)
            _offer(row, begin + row, block, 0, width - size, layout, costs, rules, tables, scratch)
        for row in range(first_row, size):
            _offer(row, begin + row, block, width - size, width, layout, costs, rules, tables, scratch)
            _settle(row, begin + row, rules, costs.outer_send, tables, scratch)


@njit(cache=True)
def _begin(row: int, end: int, costs: Costs, rules: Rules, scratch: _Scratch) -> None:
    """Start the entries of `end` with the stage from the beginning of the graph (the first of both chains:
    all-reduce over the machines inside, no transfers) and, if allowed, a replicated outer stage there."""
    c, w = costs.compute[end], costs.parameters[end]
    work = _work(c, w, rules)
    reduce = 4 * w / (rules.inner_bandwidth * rules.within_inner)
    count = fewest_replicas(work, reduce, 0.0, rules.limit, rules.inner_machines, rules.straight)
    if rules.chains and count == 1 and not _chain_fits(-1, end, costs, rules):
        count = _unfit(work, reduce, 0.0, rules)
    if costs.row_of[0] >= 0:
        count = _exact(count, costs.row_times[costs.row_of[0], end], reduce, 0.0, rules)
    scratch.best[row, :], scratch.best_source[row, :], scratch.best_source_p[row, :] = count, -1, 0
    scratch.opening_best[row, :], scratch.opening_source[row, :] = math.inf, -1
    scratch.replicated[row] = math.inf
    if rules.replicated_outer:
        inner = rules.inner_machines
        scratch.replicated[row] = max(fewest_replicas(c / (rules.workers_inside * inner),
                                                      4 * w / (rules.outer_bandwidth * inner), 0.0, rules.limit,
                                                      rules.outer_machines, rules.straight), 2.0)


@njit(cache=True)
def _work(c: float, w: float, rules: Rules) -> float:
    if rules.data_parallel:
        return c * rules.data_parallel_compute + w * rules.data_parallel_weights
    return c / rules.workers_inside


@njit(cache=True)
def _offer(row: int, end: int, block: int, first: int, stop: int, layout: Layout, costs: Costs, rules: Rules,
           tables: Tables, scratch: _Scratch) -> None:
    """Offer `end` the stages after the block's columns first..stop-1 that lie inside it (settled states)."""
    compute, parameters, limit, straight = costs.compute, costs.parameters, rules.limit, rules.straight
    machines, inner = rules.outer_machines, rules.inner_machines
    fewest_outer, fewest_inner, open_from = tables.fewest_outer, tables.fewest_inner, tables.open_from
    best, best_source, best_source_p = scratch.best, scratch.best_source, scratch.best_source_p
    c_end, w_end = compute[end], parameters[end]
    width = layout.column_offsets[block + 1] - layout.column_offsets[block]
    at, first_column = layout.inside_offsets[block] + row * width, layout.column_offsets[block]
    replicated = scratch.replicated[row]
    for column in range(first, stop):
        if not layout.inside[at + column]:
            continue
        start = layout.columns[first_column + column]
        c, w = c_end - compute[start], w_end - parameters[start]
        if rules.replicated_outer and fewest_outer[start] < math.inf and w <= rules.most_replicated_weights:
            moved = max(costs.outer_send[start], costs.outer_out[end])
            count = fewest_replicas(c / (rules.workers_inside * inner), 4 * w / rules.outer_bandwidth, moved, limit,
                                    machines, straight)
            replicated = min(replicated, fewest_outer[start] + max(count, 2.0))
        opens, continues = open_from[start] < machines, fewest_inner[start, machines - 1] < math.inf
        if c > rules.window or not (opens or continues):
            continue  # no next-level stage this long fits
        work = _work(c, w, rules)
        # Opening its outer stage (the first of its chain): all-reduce over the machines inside, no transfers.
        opening_reduce, continuing_reduce = 4 * w / (rules.inner_bandwidth * rules.within_inner), 4 * w / rules.inner_bandwidth
        opening = fewest_replicas(work, opening_reduce, 0.0, limit, inner, straight) if opens else math.inf
        moved = max(costs.inner_send[start], costs.inner_out[end])
        continuing = fewest_replicas(work, continuing_reduce, moved, limit, inner, straight) if continues else math.inf
        if rules.chains and (opening == 1 or continuing == 1) and not _chain_fits(start, end, costs, rules):
            if opening == 1:
                opening = _unfit(work, opening_reduce, 0.0, rules)
            if continuing == 1:
                continuing = _unfit(work, continuing_reduce, moved, rules)
        exact = costs.row_of[start + 1]
        if exact >= 0:
            time = costs.row_times[exact, end]
            opening = _exact(opening, time, opening_reduce, 0.0, rules)
            continuing = _exact(continuing, time, continuing_reduce, moved, rules)
        threshold = open_from[start]
        # threshold == machines: no stage opens after `start` (opening is inf); the table has no such column
        # (numba does not check bounds; plain Python, without numba, does).
        if threshold < machines and opening < scratch.opening_best[row, threshold]:
            scratch.opening_best[row, threshold], scratch.opening_source[row, threshold] = opening, start
        if continuing < math.inf:
            for p in range(machines):
                value = continuing + fewest_inner[start, p]
                if value < best[row, p]:
                    best[row, p], best_source[row, p], best_source_p[row, p] = value, start, p
    scratch.replicated[row] = replicated


@njit(cache=True)
def _unfit(work: float, reduce: float, moved: float, rules: Rules) -> float:
    """Machines of a stage one machine's workers cannot run (chains): 2 where the replica rule allows it,
    else 3 (never more than the truth)."""
    limit = rules.limit
    raised = math.inf if rules.straight else (2.0 if work / 2 + reduce / 4 <= limit and moved / 2 <= limit else 3.0)
    return raised if raised <= rules.inner_machines else math.inf


@njit(cache=True)
def _exact(count: float, time: float, reduce: float, moved: float, rules: Rules) -> float:
    """`count` raised to what the exact inner `time` of the stage needs (nan: the row does not reach it)."""
    if math.isnan(time) or count == math.inf:
        return count
    return max(count, fewest_replicas(time, reduce, moved, rules.limit, rules.inner_machines, rules.straight))


@njit(cache=True)
def _settle(row: int, end: int, rules: Rules, outer_send: np.ndarray, tables: Tables, scratch: _Scratch) -> None:
    """Final entries of `end` (the block's `row`): a stage opening an outer one after s needs p >= open_from[s]
    (a running minimum over the thresholds); at most p outer machines before (a running minimum over p, the
    first p' of the least); the unreplicated outer stage closing there (fewest machines before it; one after
    others sends its output on, except from the whole graph), or the replicated alternative; and whether an
    unreplicated outer stage may open after it (its input arrives within the limit)."""
    machines, limit, last = rules.outer_machines, rules.limit, len(outer_send) - 1
    best, best_source, best_source_p = scratch.best[row], scratch.best_source[row], scratch.best_source_p[row]
    running, running_source = math.inf, -1
    for p in range(machines):
        if scratch.opening_best[row, p] < running:
            running, running_source = scratch.opening_best[row, p], scratch.opening_source[row, p]
        if running < best[p]:
            best[p], best_source[p], best_source_p[p] = running, running_source, tables.closed_at[running_source]
    fewest_inner = tables.fewest_inner
    running, kept = math.inf, 0
    for p in range(machines):
        if best[p] < running:
            running, kept = best[p], p
        fewest_inner[end, p] = running
        tables.source[end, p], tables.source_p[end, p] = best_source[kept], best_source_p[kept]
    leaves = end == last or outer_send[end] <= limit
    first_fit = -1
    for p in range(machines):
        if fewest_inner[end, p] <= rules.inner_machines and (p == 0 or leaves):
            first_fit = p
            break
    closing = first_fit + 1.0 if first_fit >= 0 else math.inf
    replicated = scratch.replicated[row]
    if closing <= replicated:
        tables.fewest_outer[end], tables.closed_at[end] = closing, first_fit
    else:
        tables.fewest_outer[end], tables.closed_at[end] = replicated, -1
    if end < last and outer_send[end] <= limit and tables.fewest_outer[end] < machines:
        tables.open_from[end] = int(tables.fewest_outer[end])
