"""`solve(states, hierarchy, options) -> Solution`: PipeDream's DP on every level of a hierarchy.

Solves each level innermost first (`dp.py`; with worker speeds, once per distinct speed profile), then
follows the recorded splits outermost first down to the innermost parts, giving each part its machines
at every level. A bounded solve (`search/bounded.py`) passes `Limits`: the rows, splits and cells each
level may use.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from model_parallel.errors import PlanError
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.dp import LevelTables, Part, all_rows, analyze, range_table, solve_level
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.states import States
from model_parallel.optimizer.straight import straight_partition

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Solution:
    """The raw optimizer result before it becomes a Plan: best time and innermost parts in order."""

    time_s: float
    parts: tuple[Part, ...]
    states: States
    exact: bool = True  # optimal over every cut PipeDream considers (and possibly more)
    states_considered: int = 0  # cut states before bounding (bounded solves)
    # Per part, its replicas at each level (innermost first); per boundary between parts i and i+1,
    # the outermost level that splits there (its bandwidth carries the activations). Empty = one level.
    level_replicas: tuple[tuple[int, ...], ...] = ()
    boundary_levels: tuple[int, ...] = ()
    part_ranks: tuple[tuple[int, ...], ...] = ()  # per part, the workers the hierarchy gives it (empty = in order)
    speeds_simplified: bool = False  # planned with each outer level's slowest profile on every machine
    lower_bound_s: Optional[float] = None  # not exact: a time no plan beats (search/relaxation.py), if known


@dataclass(frozen=True)
class Limits:
    """What a bounded solve lets each level (innermost first) use: the states whose table rows it solves
    (-1 = from the start; the innermost level's are also its table's rows), the states that may end a
    stage other than the last (bool per state), and the cells (`dp.solve_level`'s `cells`) or None."""

    rows: tuple[np.ndarray, ...]
    splittable: tuple[np.ndarray, ...]
    cells: tuple[Optional[np.ndarray], ...]


def dp_work(
    num_states: int, hierarchy: Hierarchy, options: PartitionOptions, solves: Optional[Sequence[int]] = None,
) -> float:
    """Rough count of array elements the DP touches (inner levels solve every row: cubic in states);
    `solves[l]`: how many times level l is solved (one per speed profile; default once)."""
    total = 0.0
    for number, level in enumerate(hierarchy.levels):
        m = level.num_machines
        per_cell = (m - 1) if options.straight_pipeline else m * (m - 1) / 2
        rows = 1 if number == len(hierarchy.levels) - 1 else num_states / 3
        total += rows * num_states * num_states / 2 * max(per_cell, 1) * (solves[number] if solves else 1)
    return total


def affordable_cut_points(hierarchy: Hierarchy, options: PartitionOptions, solves: Optional[Sequence[int]] = None) -> int:
    low, high = 2, 1 << 20
    while low < high:  # largest S with dp_work(S) <= budget
        mid = (low + high + 1) // 2
        if dp_work(mid, hierarchy, options, solves) <= options.tuning.work_budget:
            low = mid
        else:
            high = mid - 1
    return low


def better(current: Solution, candidate: Optional[Solution]) -> Solution:
    """`candidate` unless it is missing or slower; solves over more cuts sum in another order, so a
    tie within the last bits goes to the candidate (it covers the current one's cuts)."""
    if candidate is None or not candidate.time_s <= current.time_s * (1 + 1e-12):
        return current
    return candidate


def solve(
    states: States, hierarchy: Hierarchy, options: PartitionOptions, limits: Optional[Limits] = None,
) -> Solution:
    """Run the DP over every level and reconstruct the innermost parts (replicas multiplied out).

    With `limits` (a bounded solve, `search/bounded.py`), each level solves only the rows, splits and
    cells they allow: exact for the plans that use only those.
    """
    memory = hierarchy.memory_bytes if options.use_memory_constraint else None
    levels = hierarchy.levels
    check_speed_count(options, hierarchy)
    if (
        len(levels) == 1
        and options.straight_pipeline
        and states.kind.startswith("topological")
        and limits is None
    ):
        value, parts = straight_partition(
            states, options.worker_speeds or (1.0,) * levels[0].num_machines, levels[0].bandwidth,
            options.activation_compression_ratio, options.use_fewer_machines, memory, options.memory,
        )
        return Solution(value, tuple(parts), states, exact=False)
    speeds = None if options.worker_speeds is None else _speed_array(options.worker_speeds, hierarchy)
    if speeds is not None and len(levels) > 1:
        if options.use_fewer_machines:
            raise PlanError(
                "worker_speeds on a hierarchy cannot leave workers idle (use_fewer_machines): the DP does not place "
                "idle workers by speed; drop use_fewer_machines or use a one-level straight pipeline"
            )
        tables_for = _tables_by_speed(states, hierarchy, options, memory)
        counts = profile_counts(options.worker_speeds, hierarchy)
        if dp_work(states.num_states, hierarchy, options, counts) <= max(options.tuning.work_budget, dp_work(states.num_states, hierarchy, options)):
            return _reconstruct(states, hierarchy, tables_for, speeds)
        # Every machine of an outer level gets the slowest speed at each position inside it: one profile
        # per level, and the plan's time holds on the real (no slower) workers.
        logger.warning(
            "worker speeds on %d workers differ in %d ways across the hierarchy, too many to solve each; planning as "
            "if every server had the slowest worker of each position (plan.extra['worker_speeds_simplified'])",
            hierarchy.num_workers, sum(counts),
        )
        uniform = np.broadcast_to(speeds.min(axis=tuple(range(speeds.ndim - 1)), keepdims=True), speeds.shape)
        return replace(_reconstruct(states, hierarchy, tables_for, uniform), speeds_simplified=True)

    # Only PipeDream's own state space keeps its not-a-range table entries (needed to reproduce it).
    strict = None if states.kind == "antichain" else states.pred_mask
    one_level = len(levels) == 1
    if one_level:  # only ranges from the start are read (last stages come from cumulative sums)
        table_rows = np.array([-1])
    else:
        # Bounded, the innermost level reads its last stages' ranges as differences of the sums, so its
        # tables need only the rows it solves (outer levels read their compute from the level inside).
        table_rows = all_rows(states.num_states) if limits is None else limits.rows[0]
    sums = (states.compute, states.activation, states.parameters)
    compute = range_table(states.compute, strict, table_rows)
    all_tables: list[LevelTables] = []
    within = 1
    for number, level in enumerate(levels):
        activation = range_table(states.activation, strict, table_rows)
        parameters = range_table(states.parameters, strict, table_rows)
        level_limits = {}
        if limits is not None:
            level_limits = dict(
                solve_rows=np.searchsorted(table_rows, limits.rows[number]), splittable=limits.splittable[number],
                cells=limits.cells[number],
            )
        tables = solve_level(
            compute, activation, parameters, states.output, states.pred_mask,
            level.num_machines, within, level.bandwidth, final_level=number == len(levels) - 1,
            straight_pipeline=options.straight_pipeline, use_fewer_machines=options.use_fewer_machines,
            activation_compression_ratio=options.activation_compression_ratio,
            memory_limit=memory, memory_model=options.memory,
            cumulative=sums if one_level or (number == 0 and limits is not None) else None,
            row_states=table_rows, worker_speeds=speeds, **level_limits,
        )
        # The best time of each range on all of this level's machines is its compute time one level up.
        compute = tables.best[:, :, -1].copy()
        table_rows = tables.row_states
        within = level.num_machines
        all_tables.append(tables)
    return _reconstruct(states, hierarchy, lambda level, _: all_tables[level], speeds)


def check_speed_count(options: PartitionOptions, hierarchy: Hierarchy) -> None:
    if options.worker_speeds is not None and len(options.worker_speeds) != hierarchy.num_workers:
        raise PlanError(
            f"worker_speeds has {len(options.worker_speeds)} value(s) but the hierarchy "
            f"{[level.num_machines for level in hierarchy.levels]} has {hierarchy.num_workers} worker(s); "
            "give one speed per worker"
        )


def _speed_array(worker_speeds: Sequence[float], hierarchy: Hierarchy) -> np.ndarray:
    """Speeds as [outermost machine, ..., innermost worker]: ranks number workers innermost first."""
    return np.array(worker_speeds, dtype=np.float64).reshape([level.num_machines for level in hierarchy.levels[::-1]])


def profile_counts(worker_speeds: Sequence[float], hierarchy: Hierarchy) -> list[int]:
    """Per level (innermost first), how many distinct speed blocks its DP is solved for: the whole
    hierarchy at the top, and below it the elementwise minimum over every window of consecutive machines."""
    speeds = _speed_array(worker_speeds, hierarchy)
    found: list[set[bytes]] = [set() for _ in range(speeds.ndim)]

    def visit(block: np.ndarray) -> None:
        level = block.ndim - 1
        if block.tobytes() in found[level]:
            return
        found[level].add(block.tobytes())
        if level:
            for first in range(len(block)):
                for last in range(first + 1, len(block) + 1):
                    visit(block[first:last].min(axis=0))

    visit(speeds)
    return [len(blocks) for blocks in found]


def _tables_by_speed(
    states: States, hierarchy: Hierarchy, options: PartitionOptions, memory: Optional[float],
) -> Callable[[int, np.ndarray], LevelTables]:
    """The DP tables of a level for the speeds of its machines (`block`: [machine, ..., innermost worker]).

    Replicas of a stage run the same inner plan and are dealt microbatches round-robin, so a stage on
    machines a .. b of level l runs at the pace of the inner plan on the slowest of them at every
    position: its compute is level l-1's best time for the elementwise minimum of their speed blocks.
    Machines with equal blocks share one solve (usually most of them; `_profile_counts` counts them).
    """
    levels = hierarchy.levels
    rows = all_rows(states.num_states)
    strict = None if states.kind == "antichain" else states.pred_mask
    compute, activation, parameters = (range_table(v, strict, rows) for v in (states.compute, states.activation, states.parameters))
    solved: dict[tuple[int, bytes], LevelTables] = {}

    def tables(number: int, block: np.ndarray) -> LevelTables:
        key = (number, block.tobytes())
        if key not in solved:
            level = levels[number]

            def window(first: int, count: int) -> np.ndarray:
                return tables(number - 1, block[first: first + count].min(axis=0)).best[:, :, -1]

            solved[key] = solve_level(
                compute if number == 0 else window(0, level.num_machines), activation, parameters, states.output,
                states.pred_mask, level.num_machines, levels[number - 1].num_machines if number else 1, level.bandwidth,
                final_level=number == len(levels) - 1, straight_pipeline=options.straight_pipeline,
                use_fewer_machines=options.use_fewer_machines, activation_compression_ratio=options.activation_compression_ratio,
                memory_limit=memory, memory_model=options.memory, row_states=rows,
                worker_speeds=block if number == 0 else None, window_compute=window if number else None,
            )
        return solved[key]

    return tables


def _reconstruct(
    states: States, hierarchy: Hierarchy, tables_for: Callable[[int, Optional[np.ndarray]], LevelTables],
    speeds: Optional[np.ndarray],
) -> Solution:
    """Follow the recorded splits outermost level first down to the innermost parts (replicas multiplied
    out), giving each part its machines at every level; `tables_for(level, speed block)` (block None
    without speeds) is the level's DP for the part being split."""
    top = len(hierarchy.levels) - 1
    value = float(tables_for(top, speeds).best[0, states.num_states - 1, -1])
    exact = states.kind in ("antichain", "all", "bounded")
    if not math.isfinite(value):
        return Solution(value, (), states, exact)
    parts = [Part(0, states.num_states, 1)]
    replicas: list[tuple[int, ...]] = [()]
    offsets: list[tuple[int, ...]] = [()]  # per part, its first machine at each level (innermost first)
    blocks: list[Optional[np.ndarray]] = [speeds]  # per part, the speeds of the machines it splits over
    boundaries: list[int] = []
    for level in reversed(range(top + 1)):
        inner: list[Part] = []
        inner_replicas: list[tuple[int, ...]] = []
        inner_offsets: list[tuple[int, ...]] = []
        inner_blocks: list[Optional[np.ndarray]] = []
        inner_boundaries: list[int] = []
        for index, (part, outer, outer_offsets, block) in enumerate(zip(parts, replicas, offsets, blocks)):
            if index:
                inner_boundaries.append(boundaries[index - 1])
            subs = analyze(tables_for(level, block), part.start, part.end)
            first = 0  # the DP gives a level's parts its machines in order, from the first one
            for number, sub in enumerate(subs):
                if number:
                    inner_boundaries.append(level)
                inner.append(Part(sub.start, sub.end, sub.replicas * part.replicas))
                inner_replicas.append((sub.replicas, *outer))
                inner_offsets.append((first, *outer_offsets))
                inner_blocks.append(None if block is None or level == 0 else block[first: first + sub.replicas].min(axis=0))
                first += sub.replicas
        parts, replicas, offsets, blocks, boundaries = inner, inner_replicas, inner_offsets, inner_blocks, inner_boundaries
    ranks = tuple(hierarchy_ranks(hierarchy, r, o) for r, o in zip(replicas, offsets))
    return Solution(
        value, tuple(parts), states, exact, level_replicas=tuple(replicas), boundary_levels=tuple(boundaries),
        part_ranks=ranks,
    )


def hierarchy_ranks(hierarchy: Hierarchy, replicas: tuple[int, ...], offsets: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks of a part that holds machines `offsets[l] .. offsets[l] + replicas[l] - 1` at each level l.

    Ranks number workers innermost first (`-n 4 2`: ranks 0-3 in server 0, 4-7 in server 1), so a part
    replicated across servers sits on the same GPUs of each: what the cost model assumed about which
    link carries its all-reduce and its activations.
    """
    ranks = [0]
    within = 1
    for level, count, first in zip(hierarchy.levels, replicas, offsets):
        ranks = [rank + (first + i) * within for i in range(count) for rank in ranks]
        within *= level.num_machines
    return tuple(sorted(ranks))
