"""Which cells of a level's DP table a plan within a time bound can use: exact pruning per row, end state and machine count.

A level-l table row starting after state a holds the best plans of ranges (a, j] on m of the level's
machines (each a group of G workers: the product of the machine counts inside). In a whole plan such a
range is the first part of a stage of the next level up that starts after a, and that stage has a
context: `base` workers do all the compute before a (every earlier stage, replicas counted), and R
copies run its plan (the product of the replica counts of the stages around it, at every level above).
Every stage takes at least its compute over its workers (`bounds.py`), so in a plan taking at most T
the cell (a, j, m) can only be used when, for some context of the row,

    C(j) - C(a) <= m G R T                  (the range, on its m G R workers), and
    C_total - C(j) <= (N - base - m G R) T  (everything after it, on all other workers; with
                                             use_fewer_machines idle ones too, so this still holds).

Contexts (`stage_contexts`): the outermost level's only row has (0, 1); a stage that starts after `used`
machines of a level-(l+1) context (base, R) and runs on r of them gives its row at level l the context
(base + R used G', R r), G' the workers of one level-(l+1) machine. A row after state a admits a
context when C(a) <= base T and C_total - C(a) <= (N - base) T (the start: base 0 only).

Where the workers have little slack (N T - C_total small against T, e.g. 16 workers on inception_v3)
each cell keeps a window of end states a few percent of the graph wide, instead of every state after
its row, and `dp.solve_level(cells=...)` solves only those; with far more workers than the graph can
balance (1024 on 1000 nodes) every cell stays and the plain bounded DP is cheaper (`level_cell_work`
says which).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.search.bounds import ROUNDING, LevelBounds, bounded_level_work, row_states as bounded_rows
from model_parallel.optimizer.options import PartitionOptions

# Most (row, context) pairs a level's cells are worked out for (a few array operations on each).
MAX_ROW_CONTEXTS = 200_000
_ROW_CHUNK = 256


def stage_contexts(hierarchy: Hierarchy, straight_pipeline: bool = False) -> list[np.ndarray]:
    """Per level (innermost first): the distinct (base, R) contexts a table row can have, shape (K, 2)."""
    levels = hierarchy.levels
    workers_per_machine = [1]
    for level in levels:
        workers_per_machine.append(workers_per_machine[-1] * level.num_machines)
    contexts: list[set[tuple[int, int]]] = [set() for _ in levels]
    contexts[-1] = {(0, 1)}
    for number in range(len(levels) - 2, -1, -1):
        outer = levels[number + 1].num_machines
        unit = workers_per_machine[number + 1]
        for base, copies in contexts[number + 1]:
            for used in range(outer):
                for replicas in (1,) if straight_pipeline else range(1, outer - used + 1):
                    contexts[number].add((base + copies * used * unit, copies * replicas))
    return [np.array(sorted(found), dtype=np.int64).reshape(-1, 2) for found in contexts]


def _windows(
    compute: np.ndarray, row_states: np.ndarray, number: int, hierarchy: Hierarchy, upper_bound: float,
    straight_pipeline: bool,
) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`(row_compute, low, high)`: per row, context and machine count m = 1..M, the compute interval
    [low, high] of the end states its cells may use (low > high: none); None when the rows and contexts
    are too many to work out."""
    contexts = stage_contexts(hierarchy, straight_pipeline)[number]
    if len(row_states) * len(contexts) > MAX_ROW_CONTEXTS or not math.isfinite(upper_bound):
        return None
    limit = upper_bound * (1.0 + ROUNDING)
    total, workers = float(compute[-1]), hierarchy.num_workers
    group = hierarchy.num_workers
    for level in hierarchy.levels[number:]:
        group //= level.num_machines  # workers of one machine of this level
    row_compute = np.where(row_states >= 0, compute[np.maximum(row_states, 0)], 0.0)
    base, copies = contexts[:, 0][None, :].astype(np.float64), contexts[:, 1][None, :].astype(np.float64)
    at_start = (row_states < 0)[:, None]
    admits = np.where(at_start, base == 0, (base > 0) & (row_compute[:, None] <= base * limit))
    admits &= total - row_compute[:, None] <= (workers - base) * limit
    machines = np.arange(1, hierarchy.levels[number].num_machines + 1, dtype=np.float64)[None, None, :]
    slots = (machines * group) * copies[:, :, None]  # workers of the range: m G R
    high = row_compute[:, None, None] + slots * limit
    # A state inside another may sum to a hair less when only zero-compute nodes tell them apart.
    low = np.maximum(row_compute[:, None, None], total - (workers - base[:, :, None] - slots) * limit) - ROUNDING * total
    high = np.where(admits[:, :, None], high, -math.inf)
    return row_compute, low, high


def level_cell_work(
    compute: np.ndarray, row_states: np.ndarray, number: int, hierarchy: Hierarchy, upper_bound: float,
    straight_pipeline: bool = False,
) -> float:
    """Rough count of array elements `dp.solve_level(cells=...)` touches at level `number` (an upper
    estimate: windows of one row's contexts are added, not merged); inf when not worked out."""
    windows = _windows(compute, row_states, number, hierarchy, upper_bound, straight_pipeline)
    if windows is None:
        return math.inf
    row_compute, low, high = windows
    ordered = np.sort(compute)
    counts = np.searchsorted(ordered, high, side="right") - np.searchsorted(ordered, low, side="left")
    after = len(ordered) - np.searchsorted(ordered, row_compute, side="left")
    per_machine = np.minimum(np.maximum(counts, 0).sum(axis=1), after[:, None]).astype(np.float64)  # (rows, M)
    big_m = per_machine.shape[1]
    work = 0.0
    for m in range(2, big_m + 1):
        for last in range(1, 2 if straight_pipeline else m):
            work += float(np.sum(per_machine[:, m - 1] * per_machine[:, m - last - 1]))
    return work


def cell_mask(
    compute: np.ndarray, row_states: np.ndarray, number: int, hierarchy: Hierarchy, upper_bound: float,
    straight_pipeline: bool = False,
) -> Optional[np.ndarray]:
    """Bool `[row, j, m-1]`: the cell of row `row_states[row]`, end state j and m machines may be used by
    a plan taking at most `upper_bound` (module doc); None when not worked out."""
    windows = _windows(compute, row_states, number, hierarchy, upper_bound, straight_pipeline)
    if windows is None:
        return None
    _, low, high = windows
    order = np.argsort(compute, kind="stable")
    ordered = compute[order]
    num_rows, num_contexts, big_m = high.shape
    states = len(compute)
    first = np.searchsorted(ordered, low, side="left")
    stop = np.maximum(np.searchsorted(ordered, high, side="right"), first)  # empty where low > high
    mask = np.zeros((num_rows, states, big_m), dtype=bool)
    for start in range(0, num_rows, _ROW_CHUNK):
        chunk = slice(start, min(num_rows, start + _ROW_CHUNK))
        count = chunk.stop - chunk.start
        rows = np.broadcast_to(np.arange(count)[:, None], (count, num_contexts))
        for m in range(big_m):
            # +1 where a window opens, -1 where it closes (in compute order); covered where the sum is > 0.
            edges = np.zeros((count, states + 1), dtype=np.int32)
            np.add.at(edges, (rows, first[chunk, :, m]), 1)
            np.add.at(edges, (rows, stop[chunk, :, m]), -1)
            covered = np.cumsum(edges, axis=1)[:, :states] > 0
            mask[chunk, order, m] = covered
    return mask


def bounded_plan(
    compute: np.ndarray, bounds: LevelBounds, hierarchy: Hierarchy, options: PartitionOptions,
) -> tuple[float, tuple[bool, ...]]:
    """The estimated work of a bounded solve (array elements) and, per level, whether it runs over cells."""
    total, over_cells = 0.0, []
    for number, dense in enumerate(bounded_level_work(bounds, hierarchy, options.straight_pipeline)):
        cells = math.inf
        if dense >= options.tuning.cell_min_work:
            cells = level_cell_work(
                compute, bounded_rows(bounds, number), number, hierarchy, bounds.upper_bound_s, options.straight_pipeline,
            )
        over_cells.append(cells * options.tuning.cell_gain < dense)
        total += cells if over_cells[-1] else dense
    return total, tuple(over_cells)


def used_states(
    compute: np.ndarray, bounds: LevelBounds, hierarchy: Hierarchy, options: PartitionOptions, over_cells: tuple[bool, ...],
) -> np.ndarray:
    """Bool per state: some level may use it (in a window of a level solved over cells, a split or
    start of the others) or it is the last; the DP over these states alone keeps every plan within the bound."""
    used = np.zeros(len(compute), dtype=bool)
    used[-1] = True
    order = np.argsort(compute, kind="stable")
    ordered = compute[order]
    for number, cells in enumerate(over_cells):
        windows = _windows(
            compute, bounded_rows(bounds, number), number, hierarchy, bounds.upper_bound_s, options.straight_pipeline,
        ) if cells else None
        if windows is None:
            used |= bounds.splittable[number] | bounds.starts[number]
            continue
        _, low, high = windows  # every row's windows at once: +1 where one opens, -1 where it closes
        first = np.searchsorted(ordered, low, side="left").ravel()
        stop = np.maximum(np.searchsorted(ordered, high, side="right").ravel(), first)
        edges = np.zeros(len(compute) + 1, dtype=np.int64)
        np.add.at(edges, first, 1)
        np.add.at(edges, stop, -1)
        used[order] |= np.cumsum(edges)[:-1] > 0
    return used
