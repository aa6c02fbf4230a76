"""The DP's splits over the cells a bounded solve can use (`search/cells.py`), by machine count.

`dp.solve_level` solves column by column over every row; a bounded solve with little slack wants only
a window of end states per row, so here a part on m machines splits into parts on fewer (counts in
ascending order see finished tables), and for a block of rows, m machines and m' of them on the last
stage, every column some row needs at m meets every split some row needs at m - m' in one array.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from model_parallel.optimizer.memory import MemoryModel, multipliers

INF = math.inf
_ROW_BLOCK = 64  # rows solved together at most (as `dp.py`'s column loop)


# Elements of one (rows, splits, columns) candidate array of the cell solve, and its splits per group.
_CELL_CHUNK = 1 << 22
_SPLIT_GROUP = 32


def fill_cells(
    cells: np.ndarray, blocks: list[tuple[int, int]], best: np.ndarray, split_k: np.ndarray, split_m: np.ndarray,
    last_m: np.ndarray, not_before: np.ndarray, pred_mask: np.ndarray, split_states: np.ndarray,
    solve_states: np.ndarray, split_stage: Callable[[np.ndarray, np.ndarray, int, tuple[float, float]], np.ndarray],
    memory_limited: bool, memory_model: MemoryModel, straight_pipeline: bool, use_fewer_machines: bool,
) -> None:
    """`solve_level`'s splits over the given cells only, by machine count instead of by column (a part
    on m machines splits into parts on fewer, so counts in ascending order see finished tables): for a
    block of rows, m machines and m' of them on the last stage, every column some row needs at m against
    every split some row needs at m - m', as one array. Same candidates and tie-breaks as the column loop."""
    s, big_m = best.shape[1], best.shape[2]
    columns = np.arange(s)
    for block_start, block_stop in blocks:
        block = slice(block_start, block_stop)
        num = block_stop - block_start
        first = int(np.searchsorted(split_states, solve_states[block_start] + 1))
        # The column loop reaches (row, column) only when the row starts before the column's state - 1.
        reached = (columns[None, :] >= 1) & (solve_states[block, None] < columns[None, :] - 1)
        wanted = cells[block].any(axis=0)  # [column, m]
        wanted_split = wanted[split_states[first:]]
        for m in range(1, big_m):
            if use_fewer_machines:
                table = best[block]
                take = reached & ((table[:, :, m - 1] < table[:, :, m]) | np.isinf(table[:, :, m]))
                for values in (best, split_k, split_m, last_m):
                    view = values[block]
                    view[:, :, m] = np.where(take, view[:, :, m - 1], view[:, :, m])
            js = np.flatnonzero(wanted[:, m])
            js = js[js >= 1]
            if not js.size:
                continue
            for mp in range(1, 2 if straight_pipeline else m + 1):
                q = m - mp  # the first part on q + 1 machines
                ks = split_states[first:][wanted_split[:, q]]
                ks = ks[ks < js[-1]]
                if not ks.size:
                    continue
                factor = multipliers(memory_model, big_m, m + 1 - mp, mp) if memory_limited else (0.0, 0.0)
                earlier = np.where(not_before[block][:, ks], best[block][:, ks, q], INF)  # [row, split]
                step = max(1, _CELL_CHUNK // max(1, num * ks.size))
                for start in range(0, js.size, step):
                    chunk = js[start: start + step]
                    inside = ks < chunk[-1]
                    kc = ks[inside]
                    if not kc.size:
                        continue
                    # [row, split, column], splits padded to whole groups: the minimum runs along
                    # contiguous columns, and a cell that improves finds its first best split by group.
                    groups = -(-kc.size // _SPLIT_GROUP)
                    stage = np.full((groups * _SPLIT_GROUP, chunk.size), INF)
                    np.copyto(stage[: kc.size], split_stage(kc, chunk, mp, factor), where=pred_mask[np.ix_(chunk, kc)].T)
                    first_parts = np.full((num, groups * _SPLIT_GROUP), INF)
                    first_parts[:, : kc.size] = earlier[:, inside]
                    cand = np.maximum(first_parts[:, :, None], stage[None]).reshape(num, groups, _SPLIT_GROUP, chunk.size)
                    group_best = cand.min(axis=2)
                    value = group_best.min(axis=1)
                    better = value < best[block_start:block_stop, chunk, m]
                    if better.any():
                        rows_at, cols_at = np.nonzero(better)
                        group = np.argmin(group_best[rows_at, :, cols_at], axis=1)
                        pick = group * _SPLIT_GROUP + np.argmin(cand[rows_at, group, :, cols_at], axis=1)  # first minimum
                        rows_at = rows_at + block_start
                        best[rows_at, chunk[cols_at], m] = value[better]
                        split_k[rows_at, chunk[cols_at], m] = kc[pick]
                        split_m[rows_at, chunk[cols_at], m] = q
                        last_m[rows_at, chunk[cols_at], m] = mp


# Rows solved together over cells share the last-stage times of every (split, column) pair some row of
# the block wants (about this many array passes per pair) and each pay the candidates (about one pass
# per pair and row): a row joins a block when that costs less than solving it alone.
_STAGE_PASSES = 8.0


def cell_blocks(cells: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive rows grouped (at most `_ROW_BLOCK`) where sharing the wanted columns' work pays."""
    wanted = cells.any(axis=2)  # [row, column]
    sizes = wanted.sum(axis=1).astype(np.float64)

    def cost(rows: int, columns: float) -> float:  # splits and columns both scale with the wanted columns
        return (_STAGE_PASSES + rows) * columns * columns

    blocks, first = [], 0
    union = wanted[0].copy()
    for row in range(1, len(cells)):
        merged = float(np.count_nonzero(union | wanted[row]))
        size = float(np.count_nonzero(union))
        alone = cost(row - first, size) + cost(1, sizes[row])
        if row - first >= _ROW_BLOCK or cost(row - first + 1, merged) > alone:
            blocks.append((first, row))
            first = row
            union = wanted[row].copy()
        else:
            union |= wanted[row]
    blocks.append((first, len(cells)))
    return blocks
