"""PipeDream's hierarchical dynamic program (`compute_partitioning`), vectorised with numpy.

Tables have one leading extra row (FORMATS.md): row 0 = ranges from the start, row r >= 1 = ranges
after state r-1. `A[r, j, m]` = best time of the range (row r, up to state j) on m+1 machines, with
`split_k/split_m/last_m` recording the choice so `reconstruct` can follow it. "None" in PipeDream
is `inf` here. For each machine count m every (row, j) entry depends only on entries with fewer
machines, so a whole column of rows is solved with one array operation over (row, k, m').

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


def range_table(values: np.ndarray) -> np.ndarray:
    """Row 0: `X(j)`; row r >= 1: `X(j) - X(r-1)` for j > r-1, else inf (PipeDream's None)."""
    s = len(values)
    table = np.full((s + 1, s), INF)
    table[0] = values
    diff = values[None, :] - values[:, None]  # [r-1, j] = X(j) - X(r-1)
    upper = np.triu(np.ones((s, s), dtype=bool), 1)
    table[1:] = np.where(upper, diff, INF)
    return table


def _stash_factor(memory_model: str, total: int, used_through: int, replicas: int) -> int:
    if memory_model == "1f1b":
        return math.ceil((total - used_through + replicas) / replicas)
    return math.ceil((total - used_through) / replicas)


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
) -> LevelTables:
    """One level of PipeDream's DP. `compute/activation/parameters` are (S+1, S) range tables."""
    rows_total, s = compute.shape
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

    num_rows = 1 if final_level else rows_total
    ratio = activation_compression_ratio
    # not_before[r, k]: split state k may end the first part in row r (k is no ancestor of state r-1).
    not_before = np.ones((num_rows, s), dtype=bool)
    if num_rows > 1:
        not_before[1:] = ~pred_mask[: num_rows - 1]
    mps = np.arange(1, big_m)  # machines of the last stage, m' = 1 .. M-1
    # A split always ends at an ancestor k < j, so once column k is done it never changes: solving
    # column by column (all rows and machine counts at once) equals PipeDream's m-outer loop order.
    for j in range(1, s):
        ks = np.flatnonzero(pred_mask[j])
        rows = min(num_rows, j)  # PipeDream solves j in i+1 .. S-1 for row i
        if ks.size:
            last = _last_stage_times(
                compute[ks + 1, j], parameters[ks + 1, j], stash_bytes[ks + 1, j], output[ks], output[j],
                j < s - 1, mps, big_m, bandwidth, ratio, memory_limit, memory_model, straight_pipeline,
            )  # (M-1 [m], K, M-1 [m'])
        for block_start in range(0, rows, _ROW_BLOCK):
            block = slice(block_start, min(rows, block_start + _ROW_BLOCK))
            # best[r, k] is inf for k < r: a block of rows only needs ks >= its first row.
            sub = ks[ks >= block_start] if ks.size else ks
            offset = ks.size - sub.size
            if sub.size:
                # prior[r, k, q] = best[r, k, M-1-q] (machine axis reversed so that m-1, m-2, ... is a
                # contiguous ascending slice), inf where k may not start row r's last stage.
                prior = np.where(not_before[block][:, sub, None], best[block][:, sub, ::-1], INF)  # (R, K, M)
                buffer = np.empty(prior.shape[0] * sub.size * (big_m - 1))
            for m in range(1, big_m):
                cur = best[block, j, m]
                cur_k = split_k[block, j, m]
                cur_m = split_m[block, j, m]
                cur_last = last_m[block, j, m]
                if use_fewer_machines:
                    prev = best[block, j, m - 1]
                    take = (prev < cur) | np.isinf(cur)
                    cur = np.where(take, prev, cur)
                    cur_k = np.where(take, split_k[block, j, m - 1], cur_k)
                    cur_m = np.where(take, split_m[block, j, m - 1], cur_m)
                    cur_last = np.where(take, last_m[block, j, m - 1], cur_last)
                if sub.size:
                    max_mp = 1 if straight_pipeline else m
                    # cand[r, k, m'-1] = max(best[r, k, m-m'], last stage on m' machines)
                    cand = buffer[: prior.shape[0] * sub.size * max_mp].reshape(prior.shape[0], sub.size, max_mp)
                    first = big_m - m  # prior[..., first + m' - 1] = best[..., m - m']
                    np.maximum(prior[:, :, first: first + max_mp], last[m - 1, offset:, :max_mp][None], out=cand)
                    flat = cand.reshape(cand.shape[0], -1)
                    pick = np.argmin(flat, axis=1)  # first minimum: smallest k, then fewest machines
                    value = flat[np.arange(flat.shape[0]), pick]
                    better = value < cur
                    cur = np.where(better, value, cur)
                    cur_k = np.where(better, sub[pick // max_mp], cur_k)
                    cur_m = np.where(better, m - (pick % max_mp + 1), cur_m)
                    cur_last = np.where(better, pick % max_mp + 1, cur_last)
                best[block, j, m], split_k[block, j, m] = cur, cur_k
                split_m[block, j, m], last_m[block, j, m] = cur_m, cur_last
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
