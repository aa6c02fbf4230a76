"""Exact solves over PipeDream's antichains and every topological prefix, bounded by a known plan's time.

Big branching graphs have far more antichain states than PipeDream's DP can handle (inner levels solve
every row: cubic in states). A plan of time `T` bounds the search: `bounds.py` keeps only the cut states
(with the bytes that really cross each cut) that can end a stage of a plan taking at most `T`, each
level solves only the rows the next level can start at, and where it pays only the table cells such a
plan can use (`cells.py`). The DP over what is left is exact for the union of cuts. Below the best known
time (`solve_below`) the same solve either finds the optimum or proves a lower bound. Pure numpy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Union

import numpy as np

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search.bounds import ROUNDING, LevelBounds, boundary_states, level_bounds, row_states
from model_parallel.optimizer.search.cells import bounded_plan, cell_mask, used_states
from model_parallel.optimizer.search.relaxation import relaxed_lower_bound
from model_parallel.optimizer.solve import Limits, Solution, better, dp_work, solve
from model_parallel.optimizer.antichains import Antichains, enumerate_antichains
from model_parallel.optimizer.downsets import Downsets, enumerate_downsets
from model_parallel.optimizer.states import (
    CutCosts, States, Workload, cut_costs, downset_sums, prefix_states, states_from_costs,
)


def solve_bounded(
    states: States, hierarchy: Hierarchy, options: PartitionOptions, bounds: LevelBounds, use_cells: bool = True,
) -> Solution:
    """`solve` restricted by `bounds`: each level solves only the rows where the next level may start a
    stage and splits only at its allowed states, and where it pays (`cells.bounded_plan`, unless
    `use_cells` is false) only the cells a plan within the bound's time can use: exact for plans within
    that time."""
    over_cells = bounded_plan(states.compute, bounds, hierarchy, options)[1] if use_cells else (False,) * len(hierarchy.levels)
    rows = tuple(row_states(bounds, number) for number in range(len(hierarchy.levels)))
    cells = tuple(
        cell_mask(states.compute, rows[number], number, hierarchy, bounds.upper_bound_s, options.straight_pipeline)
        if over_cells[number] else None
        for number in range(len(hierarchy.levels))
    )
    return solve(states, hierarchy, options, Limits(rows, tuple(bounds.splittable), cells))


@dataclass(frozen=True)
class CutUnion:
    """The cuts a bounded solve covers: every topological prefix and, when enumerated, PipeDream's
    antichains (distinct downsets), with each one's compute (summed once, read by several solves)."""

    downsets: tuple[int, ...]
    compute: np.ndarray
    with_antichains: bool

    def costs(self, work: Workload, keep: np.ndarray) -> CutCosts:
        """`cut_costs` of the kept cuts and of the whole graph (it ends every plan)."""
        everything = max(self.downsets, key=int.bit_count)
        return cut_costs(work, [d for d, k in zip(self.downsets, keep) if k] + [everything])


def cut_union(work: Workload, antichains: Optional[Union[Antichains, Downsets]]) -> CutUnion:
    """Every prefix of `prefix_order`, plus `antichains` when given, with their compute sums."""
    downsets = set(prefix_states(work).members)
    if antichains is not None:
        downsets.update(antichains.downsets())
    ordered = tuple(downsets)
    return CutUnion(ordered, downset_sums(work, list(ordered)), antichains is not None)


def bounded_solve(
    work: Workload, hierarchy: Hierarchy, options: PartitionOptions, union: CutUnion, upper_bound: float,
) -> Optional[Solution]:
    """The exact optimum over the cuts of `union` (every topological prefix and, when enumerated,
    PipeDream's antichains), using only the states that can bound a stage of a plan taking at most
    `upper_bound`; None when even those are too many to solve within the time budget."""
    maybe = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, 1, upper_bound)
    if float(maybe.sum()) ** 2 / 2 > options.tuning.work_budget:  # even one level on two machines touches S^2 / 2
        return None
    costs = union.costs(work, maybe)
    bounds = level_bounds(costs.compute, costs.output, hierarchy, upper_bound, options.activation_compression_ratio)
    kept = bounds.kept_states()
    costs, bounds = costs.subset(kept), bounds.restricted(kept)
    estimate, over_cells = bounded_plan(costs.compute, bounds, hierarchy, options)
    if estimate > options.tuning.work_budget:
        return None
    if any(over_cells):  # fewer states: a smaller ancestor matrix and tables
        used = used_states(costs.compute, bounds, hierarchy, options, over_cells)
        costs, bounds = costs.subset(used), bounds.restricted(used)
    if estimate + inclusion_work(len(costs.compute), options) > options.tuning.work_budget:
        return None  # the states x states ancestor matrix alone would cost more than the DP may
    states = states_from_costs(costs, "bounded" if union.with_antichains else "topological-bounded")
    solution = solve_bounded(states, hierarchy, options, bounds)
    return replace(solution, exact=union.with_antichains, states_considered=len(union.downsets))


def estimated_bounded_work(
    union: CutUnion, hierarchy: Hierarchy, options: PartitionOptions, upper_bound: float, with_inclusion: bool = False,
) -> float:
    """`bounded_work` of a bounded solve over `union` at `upper_bound`, from compute alone (transfers only
    prune more) and without the crossing bytes of every cut: milliseconds for 200,000 cuts. With
    `with_inclusion`, plus the ancestor matrix of the states it keeps (`inclusion_work`): what the
    gates compare with their budgets."""
    total = float(union.compute.max())
    maybe = boundary_states(union.compute, total, hierarchy.num_workers, 1, upper_bound)
    if float(maybe.sum()) ** 2 / 2 > options.tuning.work_budget:
        return math.inf
    compute = np.append(np.sort(union.compute[maybe]), total)  # states are solved in size order: close enough
    bounds = level_bounds(compute, np.zeros(len(compute)), hierarchy, upper_bound, None)
    kept = bounds.kept_states()
    estimate, over_cells = bounded_plan(compute[kept], bounds.restricted(kept), hierarchy, options)
    if not with_inclusion:
        return estimate
    states = int(kept.sum())
    if any(over_cells):
        states = int(used_states(compute[kept], bounds.restricted(kept), hierarchy, options, over_cells).sum())
    return estimate + inclusion_work(states, options)


def inclusion_work(num_states: int, options: PartitionOptions) -> float:
    """What the bounded DP's ancestor matrix (`states.strict_inclusion`, a bool per pair of states) costs,
    in DP elements: where the bound keeps tens of thousands of nearly equal cuts (BERT profiled in situ
    on 16 workers: 47,190) it, not the DP, took the time."""
    return options.tuning.inclusion_cost * float(num_states) ** 2


def largest_affordable_bound(
    union: CutUnion, hierarchy: Hierarchy, options: PartitionOptions, low: float, high: float, budget: float,
) -> Optional[float]:
    """The largest time in [low, high] (to 0.01%) whose bounded solve over `union` is estimated to fit
    `budget`; None when not even `low` does."""
    def fits(bound: float) -> bool:
        return estimated_bounded_work(union, hierarchy, options, bound, with_inclusion=True) <= budget

    if not fits(low):
        return None
    if fits(high):
        return high
    while high > low * (1 + 1e-4):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def solve_below(
    work: Workload, hierarchy: Hierarchy, options: PartitionOptions, union: CutUnion, upper: Solution, lower: float,
) -> Solution:
    """Bounded solves at the largest times `T` above `lower` (up to the best plan's time) that growing
    budgets allow (`Tuning.below_budgets`: the work grows steeply with `T`, and the optimum is often close above
    the lower bound). Each keeps every plan taking at most `T`: if it finds one, that is the optimum
    over `union` (exact); if not, every plan takes more than `T`, the next lower bound, and what it
    found (a real plan) replaces `upper` when faster. Returns the plan with `lower_bound_s` set unless
    exact; `upper` must be a plan (finite time). Budgets count array elements, never seconds: the result
    does not depend on the machine's load."""
    if not math.isfinite(upper.time_s):
        raise PlanError("solve_below needs a plan to improve on (a finite upper time)")
    best, proven = upper, lower
    for budget in options.tuning.below_budgets:
        bound = largest_affordable_bound(union, hierarchy, options, proven, best.time_s, budget)
        found = None if bound is None or bound <= proven else bounded_solve(work, hierarchy, options, union, bound)
        if found is None:
            continue
        if found.time_s <= bound:
            return found
        proven = bound
        best = better(best, replace(found, exact=False))
    return replace(best, exact=False, lower_bound_s=proven)


def solve_antichains(work: Workload, states: States, hierarchy: Hierarchy, options: PartitionOptions) -> Solution:
    """`solve` over PipeDream's states, the same optimum and plan, first bounded by a quick prefix plan's
    time (`bounds.py`: each level solves only the rows the next level can start at and splits only where
    a plan within that time can; on one level too: OPT's 4,520 states on 4 workers took 0.7 s unbounded,
    0.2 s bounded). The full DP runs when the bound saves less than half of it, or when no antichain plan
    is within it (the prefixes found a cut PipeDream misses)."""
    full_work = dp_work(states.num_states, hierarchy, options)
    if full_work < options.tuning.prune_min_work:
        return solve(states, hierarchy, options)
    upper = solve(prefix_states(work, options.tuning.quick_antichain_cut_points), hierarchy, options).time_s
    if math.isfinite(upper):
        bounds = level_bounds(states.compute, states.output, hierarchy, upper, options.activation_compression_ratio)
        if bounded_plan(states.compute, bounds, hierarchy, options)[0] < full_work / 2:
            pruned = solve_bounded(states, hierarchy, options, bounds)
            if pruned.time_s <= upper * (1 + ROUNDING):
                return pruned
    return solve(states, hierarchy, options)


def relaxed_bound(
    work: Workload, hierarchy: Hierarchy, options: PartitionOptions, union: CutUnion, upper_bound: float,
) -> Optional[float]:
    """`relaxation.relaxed_lower_bound` over the cuts of `union` that can bound an outermost stage of
    a plan taking at most `upper_bound`; None with worker speeds or when too many of them remain."""
    if options.worker_speeds is not None:
        return None
    group = hierarchy.num_workers // hierarchy.levels[-1].num_machines
    outer = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, group, upper_bound)
    if int(outer.sum()) > options.tuning.max_relaxed_states:
        return None
    budget = options.tuning.one_level_relaxation_budget if len(hierarchy.levels) == 1 else None
    return relaxed_lower_bound(union.costs(work, outer), hierarchy, options, upper_bound, budget=budget)


def enumerate_or_none(work: Workload, limit: int, main_source_only: bool = False) -> Optional[Union[Antichains, Downsets]]:
    """The cuts of PipeDream's antichain states (only their cuts: `downsets.py`, far faster than its walk),
    or with `main_source_only` those of its walk from the main source; None beyond `limit` states."""
    try:
        if main_source_only:
            return enumerate_antichains(work, max_states=limit, main_source_only=True)
        return enumerate_downsets(work, max_states=limit)
    except InfeasibleError:
        return None
