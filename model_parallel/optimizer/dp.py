"""PipeDream's hierarchical dynamic program (`compute_partitioning`), vectorised with numpy.

Tables have one row per start (FORMATS.md): row "-1" = ranges from the start, row "k" = ranges after
state k. By default every state starts a row; a bounded solve (`bounds.py`) asks for fewer rows and
fewer split states. `A[r, j, m]` = best time of the range (row r, up to state j) on m+1 machines, with
`split_k/split_m/last_m` recording the choice so `analyze` can follow it. "None" in PipeDream is
`inf` here. A split of column j always ends at an ancestor state k < j, so columns are solved in
order, each for all rows, machine counts m and last-stage machines m' with a few array operations
(blocks of rows, split states as the contiguous innermost axis). Given the cells a bounded solve can
use (`cells.py`), it solves only those, by machine count instead (`dp_cells.py`).

Memory models (checked with `use_memory_constraint`; bytes one worker of the stage holds): `memory.py`
(PipeDream's stash estimate "pipedream", "1f1b", and the real "footprint"), as `a A + w W`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from model_parallel.optimizer.costs import allreduce_seconds, stage_seconds, transfer_seconds
from model_parallel.optimizer.dp_cells import cell_blocks, fill_cells
from model_parallel.optimizer.memory import MemoryModel, multipliers, stage_bytes

INF = math.inf


@dataclass(frozen=True)
class LevelTables:
    """The DP result of one level: best times and the recorded choices."""

    best: np.ndarray  # (rows, S, M) seconds, inf = infeasible
    split_k: np.ndarray  # (rows, S, M) state ending the previous part, -1 = single stage
    split_m: np.ndarray  # (rows, S, M) machine index (m) of the previous part
    last_m: np.ndarray  # (rows, S, M) machines of the last stage
    num_machines: int
    bandwidth: float
    row_states: np.ndarray  # row r holds the ranges after state row_states[r] (-1 = from the start), ascending

    def row_of(self, start: int) -> int:
        """The row of ranges whose first state is `start` (i.e. after state start-1)."""
        row = int(np.searchsorted(self.row_states, start - 1))
        if row >= len(self.row_states) or self.row_states[row] != start - 1:
            raise ValueError(f"no table row starts at state {start}")
        return row


def all_rows(num_states: int) -> np.ndarray:
    """Every start: from the beginning (-1) and after each state."""
    return np.arange(-1, num_states)


def range_table(values: np.ndarray, pred_mask: Optional[np.ndarray] = None, row_states: Optional[np.ndarray] = None) -> np.ndarray:
    """Row of start -1: `X(j)`; row of start k: `X(j) - X(k)` for j > k, else inf (PipeDream's None).

    PipeDream fills every j > k in its state order, even when state k is not an ancestor of j
    (then the difference is no range at all, yet inner levels use it). Reproducing it needs that;
    with `pred_mask` (strict) only real ranges, state k an ancestor of j, get a value.
    """
    s = len(values)
    row_states = all_rows(s) if row_states is None else row_states
    table = np.full((len(row_states), s), INF)
    from_start = row_states < 0
    table[from_start] = values
    after = row_states[~from_start]
    if after.size:
        diff = values[None, :] - values[after][:, None]  # [row, j] = X(j) - X(k)
        valid = pred_mask[:, after].T if pred_mask is not None else np.arange(s)[None, :] > after[:, None]
        table[~from_start] = np.where(valid, diff, INF)
    return table


def _factors(memory_model: MemoryModel, total: int, used_through: int, replicas: int) -> tuple[float, float]:
    """`memory.multipliers` in the DP's terms: `used_through` machines up to and including this stage."""
    return multipliers(memory_model, total, used_through - replicas, replicas)


def solve_level(
    compute: np.ndarray,
    activation: np.ndarray,
    parameters: np.ndarray,
    output: np.ndarray,
    pred_mask: np.ndarray,
    num_machines: int,
    machines_within: int,
    bandwidth: float,
    final_level: bool,
    straight_pipeline: bool = False,
    use_fewer_machines: bool = False,
    activation_compression_ratio: Optional[float] = None,
    memory_limit: Optional[float] = None,
    memory_model: MemoryModel = "pipedream",
    cumulative: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
    row_states: Optional[np.ndarray] = None,
    solve_rows: Optional[np.ndarray] = None,
    splittable: Optional[np.ndarray] = None,
    worker_speeds: Optional[np.ndarray] = None,
    window_compute: Optional[Callable[[int, int], np.ndarray]] = None,
    cells: Optional[np.ndarray] = None,
) -> LevelTables:
    """One level of PipeDream's DP. `compute/activation/parameters` are range tables whose rows start
    after `row_states` (default: every state, see `range_table`); with `cumulative` = the states'
    (compute, activation, parameters) sums, row -1 alone is enough.

    `solve_rows` (indices into the table rows, ascending) are the rows solved and returned: the
    starts the next level reads (default: row -1 at the final level, else every row). `splittable`
    (bool per state) marks the states that may end a stage other than the last (default: all);
    every splittable state needs a table row.

    `worker_speeds`: machine i runs at that relative speed and stages take machines in order; a stage's
    work divides by its machine count times their slowest speed (PipeDream: by the count). Idle
    machines (`use_fewer_machines`) are not placed by speed.

    `window_compute(first, count)` (outer levels of a hierarchy whose machines differ): the compute table
    (every row) of a stage on machines first .. first+count-1, in place of `compute` (which then only
    gives the shape): the inner level's best time on those machines' slowest profile (`partition.py`).

    `cells[r, j, m-1]` (bool, per solved row; `cells.cell_mask`): only these cells are solved over
    splits, and a split only at a state whose cell (same row, the first part's machines) is one of them;
    the others keep their single-stage value. Exact for the plans that use only such cells.
    """
    # Only ranges from the start are solved or read at the outermost level, but its last stages
    # still span any (k, j]: read those from the full tables, or from `cumulative` sums
    # (X(j) - X(k), exact for a one-level problem where the tables are never built).
    s = compute.shape[1]
    big_m = num_machines
    if row_states is None:
        row_states = all_rows(compute.shape[0] - 1)
    if solve_rows is None:
        solve_rows = np.arange(1 if final_level else len(row_states))
    solve_states = row_states[solve_rows]
    split_states = np.arange(s) if splittable is None else np.flatnonzero(splittable)
    splittable = np.ones(s, dtype=bool) if splittable is None else splittable
    split_position = np.full(s, -1)
    split_position[split_states] = np.arange(len(split_states))
    full_c = full_a = full_w = row_index = None
    if cumulative is not None:
        def last_ranges(ks: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            c, a, w = cumulative
            return c[j] - c[ks], w[j] - w[ks], a[j] - a[ks]
    else:
        full_c, full_a, full_w = compute, activation, parameters
        row_index = np.full(s + 1, -1)
        row_index[row_states + 1] = np.arange(len(row_states))

        def last_ranges(ks: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            rows_k = row_index[ks + 1]
            if window_compute is None:
                range_compute = full_c[rows_k, j]
            else:  # [m-1, k, m'-1]: the last stage on machines m-m'+1 .. m
                range_compute = np.full((big_m - 1, ks.size, big_m - 1), INF)
                for m in range(1, big_m):
                    for mp in range(1, m + 1):
                        range_compute[m - 1, :, mp - 1] = window_compute(m - mp + 1, mp)[rows_k, j]
            return range_compute, full_w[rows_k, j], full_a[rows_k, j]
    sources = cumulative if cumulative is not None else (full_c, full_a, full_w)

    def split_stage(ks: np.ndarray, js: np.ndarray, mp: int, factor: tuple[float, float]) -> np.ndarray:
        """[split, column]: the last stage after state ks[p] up to state js[c] on mp machines (no ancestor
        test): `_last_stage_times`' terms in the same order, so the values are the same to the bit."""
        if cumulative is not None:
            def ranges(values: np.ndarray) -> np.ndarray:
                return values[js][None, :] - values[ks][:, None]
        else:
            rows_k = row_index[ks + 1][:, None]

            def ranges(values: np.ndarray) -> np.ndarray:
                return values[rows_k, js[None, :]]
        range_compute = ranges(sources[0])
        if mp > 1:
            time = stage_seconds(range_compute, ranges(sources[2]), mp, bandwidth)
        else:
            time = range_compute  # x / 1 is x
        if ratio is not None:
            np.maximum(time, transfer_seconds(output[ks], bandwidth, mp, ratio)[:, None], out=time)
            sends = np.where(js < s - 1, transfer_seconds(output[js], bandwidth, mp, ratio), -INF)  # the last state sends nothing
            np.maximum(time, sends[None, :], out=time)
        if cumulative is None or memory_limit is not None:  # sums of states are finite; table entries may not be
            ok = np.isfinite(range_compute)
            if memory_limit is not None:
                with np.errstate(invalid="ignore"):
                    ok &= stage_bytes(factor, ranges(sources[1]), ranges(sources[2])) <= memory_limit
            time[~ok] = INF
        return time

    compute, activation, parameters = compute[solve_rows], activation[solve_rows], parameters[solve_rows]
    rows_total = len(solve_rows)
    best = np.full((rows_total, s, big_m), INF)
    split_k = np.full((rows_total, s, big_m), -1, dtype=np.int32)
    split_m = np.full((rows_total, s, big_m), -1, dtype=np.int32)
    last_m = np.zeros((rows_total, s, big_m), dtype=np.int32)

    speed_sums = None
    if worker_speeds is not None:
        # The runtime deals a replicated stage's microbatches round-robin: its r machines each do 1/r
        # of the work, so the slowest sets the pace: the work divides by r * min(speed).
        speed_sums = np.full((big_m - 1, big_m - 1), np.inf)
        for m in range(1, big_m):
            for mp in range(1, m + 1):
                speed_sums[m - 1, mp - 1] = mp * float(np.min(worker_speeds[m - mp + 1: m + 1]))
    # Single stage over each range, replicated on m+1 machines.
    with np.errstate(invalid="ignore"):
        for m in range(1 if straight_pipeline else big_m):
            share = (m + 1) if worker_speeds is None else (m + 1) * float(np.min(worker_speeds[: m + 1]))
            single = compute if window_compute is None else window_compute(0, m + 1)[solve_rows]
            value = stage_seconds(single, parameters, m + 1, bandwidth, machines_within, pace=share)
            ok = np.isfinite(single)
            if memory_limit is not None:
                # inf where the range does not exist
                ok &= stage_bytes(_factors(memory_model, big_m, m + 1, m + 1), activation, parameters) <= memory_limit
            best[:, :, m] = np.where(ok, value, INF)
            last_m[:, :, m] = np.where(ok, m + 1, 0)

    ratio = activation_compression_ratio
    # not_before[r, k]: split state k may end the first part of row r (k is no ancestor of its start).
    not_before = np.ones((rows_total, s), dtype=bool)
    after = solve_states >= 0
    not_before[after] = ~pred_mask[solve_states[after]]
    mps = np.arange(1, big_m)  # machines of the last stage, m' = 1 .. M-1
    if cells is not None:
        assert worker_speeds is None and window_compute is None, "bounded solves (cells) never carry worker speeds"
        blocks = cell_blocks(cells)
        fill_cells(
            cells, blocks, best, split_k, split_m, last_m, not_before, pred_mask, split_states, solve_states,
            split_stage, memory_limit is not None, memory_model, straight_pipeline, use_fewer_machines,
        )
        return LevelTables(best, split_k, split_m, last_m, big_m, bandwidth, solve_states)
    # prior[r, q, p] = best[r, k, M-1-q] for the p-th split state k, or inf where k may not end the
    # first part of row r: the machine axis is reversed so that best[.., m-1], best[.., m-2], ... is
    # an ascending slice, split states are the innermost (contiguous, vectorised) axis, and the table
    # is kept up to date column by column so that a block of rows reads it as a plain view.
    prior = np.ascontiguousarray(np.where(
        not_before[:, None, split_states], best[:, split_states, ::-1].transpose(0, 2, 1), INF
    ))
    blocks = _row_blocks(np.searchsorted(split_states, solve_states + 1))
    # A split always ends at an ancestor k < j, so once column k is done it never changes: solving
    # column by column (all rows and machine counts at once) equals PipeDream's m-outer loop order.
    for j in range(1, s):
        ks = np.flatnonzero(pred_mask[j] & splittable)
        # Rows starting after state j-1 or later have no split inside (k must lie strictly between).
        rows = int(np.searchsorted(solve_states, j - 1))
        splits_before = int(np.searchsorted(split_states, j))  # split positions of states < j
        if ks.size:
            # last[m-1, m'-1, p] for every split position p < splits_before; inf where no ancestor of j.
            times = _last_stage_times(
                *last_ranges(ks, j), output[ks], output[j],
                j < s - 1, mps, big_m, bandwidth, ratio, memory_limit, memory_model, straight_pipeline, speed_sums,
            )
            last = np.full((times.shape[0], big_m - 1, splits_before), INF)
            last[:, :, split_position[ks]] = times.transpose(0, 2, 1)
            per_m = times.shape[0] > 1
        for block_start, block_stop in blocks:
            if block_start >= rows:
                break
            block = slice(block_start, min(rows, block_stop))
            num = block.stop - block.start
            # best[r, k] is inf unless k comes after r's start: a block only needs splits after its first start.
            first_split = int(np.searchsorted(split_states, solve_states[block.start] + 1))
            width = splits_before - first_split
            if ks.size and width > 0:
                block_prior = prior[block, :, first_split:splits_before]  # (R, M, K), a view
                buffer = np.empty(num * width * (big_m - 1))
                rows_index = np.arange(num)
            block_best = best[block, j, :]
            block_k = split_k[block, j, :]
            block_m = split_m[block, j, :]
            block_last = last_m[block, j, :]
            for m in range(1, big_m):
                if use_fewer_machines:
                    take = (block_best[:, m - 1] < block_best[:, m]) | np.isinf(block_best[:, m])
                    for column in (block_best, block_k, block_m, block_last):
                        column[take, m] = column[take, m - 1]
                if ks.size and width > 0:
                    max_mp = 1 if straight_pipeline else m
                    first = big_m - m  # block_prior[..., first + m' - 1] = best[..., m - m']
                    cand = buffer[: num * width * max_mp].reshape(num, max_mp, width)
                    np.maximum(block_prior[:, first: first + max_mp, :], last[m - 1 if per_m else 0, :max_mp, first_split:][None], out=cand)
                    flat = cand.reshape(num, -1)
                    pick = np.argmin(flat, axis=1)  # first minimum: fewest machines, then smallest k
                    value = flat[rows_index, pick]
                    better = value < block_best[:, m]
                    if better.any():
                        pick = pick[better]
                        block_best[better, m] = value[better]
                        block_k[better, m] = split_states[first_split + pick % width]
                        block_m[better, m] = m - (pick // width + 1)
                        block_last[better, m] = pick // width + 1
            best[block, j, :], split_k[block, j, :] = block_best, block_k
            split_m[block, j, :], last_m[block, j, :] = block_m, block_last
        if rows and splittable[j]:
            prior[:rows, :, split_position[j]] = np.where(not_before[:rows, j, None], best[:rows, j, ::-1], INF)
    return LevelTables(best, split_k, split_m, last_m, big_m, bandwidth, solve_states)


_ROW_BLOCK = 64
# A block reads every split after its first row's start; a row whose own start is this many splits later
# begins a new block instead of computing (inf) candidates it can never use.
_BLOCK_GAP = 256


def _row_blocks(first_splits: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive rows (ascending starts) grouped at most `_ROW_BLOCK` at a time, a new group wherever
    the first split a row may use lies over `_BLOCK_GAP` splits after its group's first row's."""
    blocks, first = [], 0
    for row in range(1, len(first_splits)):
        if row - first >= _ROW_BLOCK or first_splits[row] - first_splits[first] > _BLOCK_GAP:
            blocks.append((first, row))
            first = row
    blocks.append((first, len(first_splits)))
    return blocks


def _last_stage_times(
    range_compute: np.ndarray, range_params: np.ndarray, range_act: np.ndarray, output_in: np.ndarray,
    output_out: float, has_output: bool, mps: np.ndarray, big_m: int, bandwidth: float,
    ratio: Optional[float], memory_limit: Optional[float], memory_model: MemoryModel, straight_pipeline: bool,
    speed_sums: Optional[np.ndarray] = None,
) -> np.ndarray:
    """`last[m-1, k, m'-1]`: the last stage (after split k) on m' machines, when m+1 machines are in use;
    a single `m` row when that does not depend on m (no memory limit, no speeds, one compute per split).

    Transfers do not depend on the row, so they fold into the last stage's term of the max. With
    `speed_sums[m-1, m'-1]` (m' times the slowest speed of machines m-m'+1 .. m) work divides by it, not m'.
    `range_compute` is per split k, or per `[m-1, k, m'-1]` when the machines differ (`window_compute`).
    """
    mp = mps[None, :]
    per_m = range_compute.ndim > 1 or memory_limit is not None or speed_sums is not None
    if range_compute.ndim == 1:
        range_compute = range_compute[None, :, None]
    work = range_compute + allreduce_seconds(range_params[:, None], mp, bandwidth)[None]
    if speed_sums is None:
        last = np.broadcast_to(work / mp, (big_m - 1 if per_m else 1, len(range_params), big_m - 1)).copy()
    else:  # machines m-m'+1 .. m share the work by speed (m' <= m; larger m' are never read)
        last = np.where(np.isfinite(speed_sums)[:, None, :], work / speed_sums[:, None, :], INF)
    if ratio is not None:
        transfer = transfer_seconds(output_in[:, None], bandwidth, mp, ratio)
        if has_output:
            transfer = np.maximum(transfer, transfer_seconds(output_out, bandwidth, mp, ratio))
        last = np.maximum(last, transfer[None])
    last = np.where(np.isfinite(range_compute), last, INF)
    if memory_limit is not None:
        range_stash = range_act + range_params
        for m in range(1, big_m):
            factors = np.array([_factors(memory_model, big_m, m + 1, int(r)) for r in mps], dtype=np.float64)
            with np.errstate(invalid="ignore"):
                if np.array_equal(factors[:, 0], factors[:, 1]):  # a legacy model: f (A + W), PipeDream's terms
                    held = range_stash[:, None] * factors[None, :, 0]
                else:
                    held = range_act[:, None] * factors[None, :, 0] + range_params[:, None] * factors[None, :, 1]
                last[m - 1] = np.where(held <= memory_limit, last[m - 1], INF)
    if straight_pipeline:
        last[:, :, 1:] = INF
    return last


@dataclass(frozen=True)
class Part:
    """A range of states `(start_row, end)` (states start_row .. end-1) on `replicas` copies of a machine."""

    start: int
    end: int
    replicas: int


def analyze(tables: LevelTables, start: int, end: int) -> list[Part]:
    """Follow the recorded splits of `A[start][end-1][M-1]` (PipeDream's `analyze_partitioning`)."""
    row, j, m = tables.row_of(start), end - 1, tables.num_machines - 1
    if not np.isfinite(tables.best[row, j, m]):
        return []
    parts: list[Part] = []
    while True:
        k = int(tables.split_k[row, j, m])
        used = int(tables.last_m[row, j, m])
        if k < 0:
            parts.append(Part(start, j + 1, used))
            break
        parts.append(Part(k + 1, j + 1, used))
        j, m = k, int(tables.split_m[row, j, m])
    return parts[::-1]
