"""Which cut states can matter once a plan of time `T` is known: exact pruning for big state spaces.

Every stage of a plan holds some worker slots w (replicas times the machines of the levels inside
it) and takes at least `compute / w` (transfers, all-reduce and memory only add to a stage's time or
remove candidates). So if a plan takes at most `T`, the prefix of the graph before any of its stage
boundaries, with compute `C(j)` on `m` slots, has `C(j) <= m T`, and the rest `C_total - C(j) <=
(N - m) T` (N = all workers; with `use_fewer_machines` the rest holds at most N - m). A boundary
between stages of level l (its machines are groups of `G_l` workers: the product of the machine
counts of the levels inside) has m a multiple of `G_l`. A state j with no such m is a boundary of no
plan taking at most `T`: given `T` = the time of a plan we already have, the optimum uses only the
remaining states, and the DP over them (with rows only where a next-level stage can start) is exact.

When transfers count (`activation_compression_ratio` R), a split at state k of level l makes the stage
after it (on m' <= M_l - 1 of the level's machines) take at least `2 O(k) / (B_l m') / R`, and the
levels outside divide a level-l time by at most the product of their machine counts: so k needs
`O(k) <= T B_l (M_l - 1) R / 2 * prod(M outside)`.

The test is tight when the graph can be balanced nearly perfectly (few workers, many small nodes) and
keeps everything when `T` is far above `C_total / N` (e.g. 1024 workers on 1000 nodes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.share_bound import ROUNDING  # noqa: F401 - one slack for every bound


@dataclass(frozen=True)
class LevelBounds:
    """Per level (innermost first): the states that may end one of its stages other than the last
    (`splittable`), and the states after which the next level may start a stage (`starts`; the
    final level: none, only the beginning)."""

    splittable: tuple[np.ndarray, ...]
    starts: tuple[np.ndarray, ...]
    upper_bound_s: float

    def kept_states(self) -> np.ndarray:
        """States used anywhere: a split or a start at some level, and the last state."""
        kept = np.logical_or.reduce(self.splittable)
        kept[-1] = True
        return kept

    def restricted(self, keep: np.ndarray) -> "LevelBounds":
        """The same bounds over the kept states only (state indices renumbered)."""
        return LevelBounds(tuple(m[keep] for m in self.splittable), tuple(m[keep] for m in self.starts), self.upper_bound_s)


def boundary_states(compute: np.ndarray, total: float, workers: int, unit: int, upper_bound: float) -> np.ndarray:
    """Bool per state: some m, a multiple of `unit` in [unit, workers - unit], has
    `C(j) <= m T` and `C_total - C(j) <= (workers - m) T` (module doc)."""
    limit = upper_bound * (1.0 + ROUNDING)
    if not math.isfinite(limit) or limit <= 0.0:
        return np.full(len(compute), math.isfinite(limit))
    lowest = np.maximum(np.ceil(compute / limit / unit - ROUNDING), 1) * unit
    highest = np.floor((workers - (total - compute) / limit) / unit + ROUNDING) * unit
    return lowest <= np.minimum(highest, workers - unit)


def level_bounds(
    compute: np.ndarray, output: np.ndarray, hierarchy: Hierarchy, upper_bound: float,
    activation_compression_ratio: Optional[float],
) -> LevelBounds:
    """The states each level may split at or start after, for plans taking at most `upper_bound`;
    arrays in state order (the last state holds every node and ends only the last stage)."""
    workers = hierarchy.num_workers
    limit = upper_bound * (1.0 + ROUNDING)
    splittable = []
    within = 1
    for level in hierarchy.levels:
        mask = boundary_states(compute, float(compute[-1]), workers, within, upper_bound)
        within *= level.num_machines
        if activation_compression_ratio is not None:
            outside = workers // within
            mask &= output <= limit * level.bandwidth * (level.num_machines - 1) * outside * activation_compression_ratio / 2
        mask[-1] = False
        splittable.append(mask)
    starts = tuple(splittable[1:]) + (np.zeros(len(compute), dtype=bool),)
    return LevelBounds(tuple(splittable), starts, upper_bound)


def bounded_work(bounds: LevelBounds, hierarchy: Hierarchy, straight_pipeline: bool) -> float:
    """Rough count of array elements the bounded DP touches (all levels)."""
    return sum(bounded_level_work(bounds, hierarchy, straight_pipeline))


def bounded_level_work(bounds: LevelBounds, hierarchy: Hierarchy, straight_pipeline: bool) -> list[float]:
    """Per level: a row starting at state p reads the splits after p for every column after p (about
    half of those pairs), for each pair of machine counts."""
    states = len(bounds.splittable[0])
    found = []
    for level, splittable, starts in zip(hierarchy.levels, bounds.splittable, bounds.starts):
        m = level.num_machines
        per_cell = (m - 1) if straight_pipeline else m * (m - 1) / 2
        splits_after = int(splittable.sum()) - np.cumsum(splittable)  # splittable states after each state
        rows = np.concatenate(([-1], np.flatnonzero(starts)))
        after = np.where(rows < 0, states, states - 1 - rows)
        split_after = np.where(rows < 0, int(splittable.sum()), splits_after[np.maximum(rows, 0)])
        found.append(float(np.sum(after * split_after)) / 2 * max(per_cell, 1))
    return found


def row_states(bounds: LevelBounds, number: int) -> np.ndarray:
    """The states after which level `number` solves a row (-1: from the start), ascending."""
    return np.concatenate(([-1], np.flatnonzero(bounds.starts[number])))
