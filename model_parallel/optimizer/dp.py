"""PipeDream's hierarchical dynamic program (`compute_partitioning`), vectorised with numpy.

Tables have one leading extra row (FORMATS.md): row 0 = ranges from the start, row r >= 1 = ranges
after state r-1. `A[r, j, m]` = best time of the range (row r, up to state j) on m+1 machines, with
`split_k/split_m/last_m` recording the choice so `analyze` can follow it. "None" in PipeDream is
`inf` here. A split of column j always ends at an ancestor state k < j, so columns are solved in
order, each for all rows, machine counts m and last-stage machines m' with a few array operations
(blocks of rows, split states as the contiguous innermost axis).

Memory models (checked with `use_memory_constraint`; bytes one worker of the stage holds):
- "pipedream": `ceil((M - machines_so_far) / r) * (A + W)` — PipeDream's stash estimate (the last
  stage counts 0).
- "1f1b": a 1F1B stage k of p keeps one microbatch in flight per stage from k to the end, i.e.
  `in_flight = ceil((M - machines_before) / r)`, and weight stashing keeps one weight version per
  in-flight microbatch (the newest is the live copy): `in_flight * (A + W)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from model_parallel.optimizer.costs import stash_factor

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


def range_table(values: np.ndarray, pred_mask: Optional[np.ndarray] = None, rows: Optional[int] = None) -> np.ndarray:
    """Row 0: `X(j)`; row r >= 1: `X(j) - X(r-1)` for j > r-1, else inf (PipeDream's None).

    PipeDream fills every j > r-1 in its state order, even when state r-1 is not an ancestor of j
    (then the difference is no range at all, yet inner levels use it). Reproducing it needs that;
    with `pred_mask` (strict) only real ranges, state r-1 an ancestor of j, get a value.
    """
    s = len(values)
    if rows == 1:  # a one-level problem only ever reads ranges from the start
        return values[None, :].astype(np.float64)
    table = np.full((s + 1, s), INF)
    table[0] = values
    diff = values[None, :] - values[:, None]  # [r-1, j] = X(j) - X(r-1)
    valid = pred_mask.T if pred_mask is not None else np.triu(np.ones((s, s), dtype=bool), 1)
    table[1:] = np.where(valid, diff, INF)
    return table


def _stash_factor(memory_model: str, total: int, used_through: int, replicas: int) -> int:
    """`costs.stash_factor` in the DP's terms: `used_through` machines up to and including this stage."""
    return stash_factor(memory_model, total, used_through - replicas, replicas)


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
    memory_model: str = "pipedream",
    cumulative: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
) -> LevelTables:
    """One level of PipeDream's DP. `compute/activation/parameters` are (S+1, S) range tables (row 0
    only is enough with `cumulative` = the states' (compute, activation, parameters) sums)."""
    # Only ranges from the start are solved or read at the outermost level (row 0), but its last
    # stages still span any (k, j]: read those from the full tables, or from `cumulative` sums
    # (X(j) - X(k), exact for a one-level problem where the tables are never built).
    s = compute.shape[1]
    rows_total = 1 if final_level else compute.shape[0]
    if cumulative is not None:
        def last_ranges(ks: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            c, a, w = cumulative
            return c[j] - c[ks], w[j] - w[ks], (a[j] - a[ks]) + (w[j] - w[ks])
    else:
        full_c, full_a, full_w = compute, activation, parameters

        def last_ranges(ks: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return full_c[ks + 1, j], full_w[ks + 1, j], full_a[ks + 1, j] + full_w[ks + 1, j]
    compute, activation, parameters = compute[:rows_total], activation[:rows_total], parameters[:rows_total]
    big_m = num_machines
    best = np.full((rows_total, s, big_m), INF)
    split_k = np.full((rows_total, s, big_m), -1, dtype=np.int32)
    split_m = np.full((rows_total, s, big_m), -1, dtype=np.int32)
    last_m = np.zeros((rows_total, s, big_m), dtype=np.int32)
    stash_bytes = activation + parameters  # inf where the range does not exist

    # Single stage over each range, replicated on m+1 machines.
    with np.errstate(invalid="ignore"):
        for m in range(1 if straight_pipeline else big_m):
            value = (compute + (4 * m * parameters) / (bandwidth * (m + 1)) / machines_within) / (m + 1)
            ok = np.isfinite(compute)
            if memory_limit is not None:
                ok &= _stash_factor(memory_model, big_m, m + 1, m + 1) * stash_bytes <= memory_limit
            best[:, :, m] = np.where(ok, value, INF)
            last_m[:, :, m] = np.where(ok, m + 1, 0)

    num_rows = rows_total
    ratio = activation_compression_ratio
    # not_before[r, k]: split state k may end the first part in row r (k is no ancestor of state r-1).
    not_before = np.ones((num_rows, s), dtype=bool)
    if num_rows > 1:
        not_before[1:] = ~pred_mask[: num_rows - 1]
    mps = np.arange(1, big_m)  # machines of the last stage, m' = 1 .. M-1
    # prior[r, q, k] = best[r, k, M-1-q], or inf where k may not end the first part of row r: the
    # machine axis is reversed so that best[.., m-1], best[.., m-2], ... is an ascending slice, k is
    # the innermost (contiguous, vectorised) axis, and the table is kept up to date column by
    # column so that a block of rows reads it as a plain view.
    prior = np.ascontiguousarray(np.where(not_before[:, None, :], best[:num_rows, :, ::-1].transpose(0, 2, 1), INF))
    # A split always ends at an ancestor k < j, so once column k is done it never changes: solving
    # column by column (all rows and machine counts at once) equals PipeDream's m-outer loop order.
    for j in range(1, s):
        ks = np.flatnonzero(pred_mask[j])
        rows = min(num_rows, j)  # PipeDream solves j in i+1 .. S-1 for row i
        if ks.size:
            # last[m-1, m'-1, k] for every k < j; inf where k is no ancestor of j.
            last = np.full((big_m - 1, big_m - 1, j), INF)
            last[:, :, ks] = _last_stage_times(
                *last_ranges(ks, j), output[ks], output[j],
                j < s - 1, mps, big_m, bandwidth, ratio, memory_limit, memory_model, straight_pipeline,
            ).transpose(0, 2, 1)
        for block_start in range(0, rows, _ROW_BLOCK):
            block = slice(block_start, min(rows, block_start + _ROW_BLOCK))
            num = block.stop - block.start
            # best[r, k] is inf for k < r: a block of rows only needs split states k >= its first row.
            width = j - block_start
            if ks.size and width > 0:
                block_prior = prior[block, :, block_start:j]  # (R, M, K), a view
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
                    np.maximum(block_prior[:, first: first + max_mp, :], last[m - 1, :max_mp, block_start:][None], out=cand)
                    flat = cand.reshape(num, -1)
                    pick = np.argmin(flat, axis=1)  # first minimum: fewest machines, then smallest k
                    value = flat[rows_index, pick]
                    better = value < block_best[:, m]
                    if better.any():
                        pick = pick[better]
                        block_best[better, m] = value[better]
                        block_k[better, m] = block_start + pick % width
                        block_m[better, m] = m - (pick // width + 1)
                        block_last[better, m] = pick // width + 1
            best[block, j, :], split_k[block, j, :] = block_best, block_k
            split_m[block, j, :], last_m[block, j, :] = block_m, block_last
        if rows:
            prior[:rows, :, j] = np.where(not_before[:rows, j, None], best[:rows, j, ::-1], INF)
    return LevelTables(best, split_k, split_m, last_m, big_m, bandwidth)


_ROW_BLOCK = 64


def _last_stage_times(
    range_compute: np.ndarray, range_params: np.ndarray, range_stash: np.ndarray, output_in: np.ndarray,
    output_out: float, has_output: bool, mps: np.ndarray, big_m: int, bandwidth: float,
    ratio: Optional[float], memory_limit: Optional[float], memory_model: str, straight_pipeline: bool,
) -> np.ndarray:
    """`last[m-1, k, m'-1]`: the last stage (after split k) on m' machines, when m+1 machines are in use.

    Transfers do not depend on the row, so they fold into the last stage's term of the max.
    """
    mp = mps[None, :]
    value = (range_compute[:, None] + (4 * (mp - 1) * range_params[:, None]) / (bandwidth * mp)) / mp
    if ratio is not None:
        transfer = (2.0 * output_in[:, None]) / (bandwidth * mp) / ratio
        if has_output:
            transfer = np.maximum(transfer, (2.0 * output_out) / (bandwidth * mp) / ratio)
        value = np.maximum(value, transfer)
    value = np.where(np.isfinite(range_compute)[:, None], value, INF)
    last = np.broadcast_to(value, (big_m - 1, *value.shape)).copy()
    if memory_limit is not None:
        for m in range(1, big_m):
            factors = np.array([_stash_factor(memory_model, big_m, m + 1, int(r)) for r in mps], dtype=np.float64)
            with np.errstate(invalid="ignore"):
                last[m - 1] = np.where(range_stash[:, None] * factors[None, :] <= memory_limit, last[m - 1], INF)
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
    row, j, m = start, end - 1, tables.num_machines - 1
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
