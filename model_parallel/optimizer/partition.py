"""`partition(graph, hierarchy, options) -> Plan`: PipeDream's hierarchical optimizer, exact and fast.

Pure: no I/O, no globals; the only impurity is `Plan.optimizer_seconds`, measured around the solve.
Steps: pre-process (states.py), enumerate cut states, solve each level of the hierarchy innermost
first (dp.py), follow the recorded splits outermost first down to the stages, then place nodes.

`cuts="auto"` on a graph whose antichain DP is too big for PipeDream's algorithm: a plan over the
prefixes of one topological order gives an upper bound `T`; `bounds.py` keeps only the cut states
(PipeDream's antichains and those prefixes, with the bytes that really cross each cut) that can be a
stage boundary of a plan taking at most `T`, and the DP over them is exact for that union; where it
pays, each level solves only the table cells such a plan can use (`cells.py`). Unless that is cheap
at `T`, the same solve runs at the largest times below `T` that growing budgets allow (`solve_below`):
a plan within one is the optimum; none proves a lower bound. Failing that, the best plan found is
returned with `exact: false`: on a hierarchy, plans with unreplicated outermost stages found in one
pass over the cuts compete with the prefix plans (`flattened.py`, whose relaxation also bounds the
optimum from below), elsewhere `relaxation.py` gives the bound.

When PipeDream's own antichain DP is affordable on a hierarchy, the same bound (from a quick prefix
plan) first restricts it to the rows and splits a plan within `T` can use: the same optimum and plan,
several times faster (`solve_antichains`); PipeDream's not-a-range entries keep their meaning, since
every bound there sums compute along a chain of states, which telescopes whatever the chain.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import Callable, Optional

import numpy as np

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Hierarchy, Plan, StagePlan
from model_parallel.optimizer.bounds import ROUNDING, LevelBounds, boundary_states, level_bounds, row_states
from model_parallel.optimizer.cells import bounded_plan, cell_mask, used_states
from model_parallel.optimizer.costs import data_parallel_seconds, stage_costs, stash_factor
from model_parallel.optimizer.dp import LevelTables, Part, all_rows, analyze, range_table, solve_level
from model_parallel.optimizer import states as states_module
from model_parallel.optimizer.flattened import (
    MAX_FLAT_STATES, FlatStates, flat_feasible, flat_plan_cuts, flat_states, flat_witness, included,
)
from model_parallel.optimizer.inner_rows import InnerRows
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.relaxation import MAX_RELAXED_STATES, node_share_bound, relaxed_lower_bound
from model_parallel.optimizer.states import (
    Antichains, CutCosts, States, Workload, antichain_states, cut_costs, cut_states, downset_sums, enumerate_antichains,
    finish_antichains, ideal_states, preprocess, prefix_states, states_from_costs,
)
from model_parallel.optimizer.straight import straight_partition

logger = logging.getLogger(__name__)

# "auto" keeps the DP under about this many array elements (a few seconds of numpy on one core).
AUTO_WORK_BUDGET = 2.0e9
# Most antichain states enumerated for a bounded solve (~15 us each; PipeDream's inception_v3 has 221,564).
ENUMERATION_LIMIT = 250_000
# Cut points of the quick plan whose time bounds the exact solves.
QUICK_CUT_POINTS = 200
# The antichain DP on a hierarchy tries a bound first when it touches at least this many elements (below,
# the quick plan over this many prefixes costs about what the bound saves).
PRUNE_MIN_WORK = 5e7
QUICK_ANTICHAIN_CUT_POINTS = 100
# Work (array elements) of the bounded solves below the best known time, tried in turn (`solve_below`);
# a bounded solve at the best time runs first when it fits the first.
BELOW_BUDGETS = (AUTO_WORK_BUDGET / 64, AUTO_WORK_BUDGET / 8, AUTO_WORK_BUDGET)
# The flattened search (`flat_search`): the state pairs its relaxation passes may visit in all, and
# its heuristic passes too (~50 ns each: about 3 s; 4 passes each on the 1000-node graph on 1024
# workers), at most this many passes of each; the heuristic's first step up from the relaxation's time
# and the relaxation's first step down from the best plan; the relative gap at which the searches stop.
FLAT_PASS_BUDGET = 6e7
FLAT_MOST_PASSES = 24
FLAT_FIRST_STEP = 0.01
FLAT_BOUND_FIRST_STEP = 0.02
FLAT_TOLERANCE = 0.001
# On three levels, the proof (`flat_search`): tried once the heuristic's plan is within FLAT_PROOF_WINDOW
# of the relaxation's bound (1-2% on the 1000-node graphs), for FLAT_PROOF_FIRST_PASSES relaxation passes
# with exact inner rows (enough where the heuristic found the optimum at once), and at the heuristic's final
# plan for the rest of FLAT_PROOF_PASSES (~0.13 s each on the 1000-node graph, 2 cores; 4-17 were needed
# there). A row reaches FLAT_ROW_REACH times the stage it is computed for; a stage whose start has no row
# also gets rows for the starts within FLAT_ROW_NEIGHBOURS times the time of its compute (the alternatives
# the next pass would move to); the rows' (end, split) pairs cost ~50 ns each, FLAT_ROWS_BUDGET in all. It
# proves that no plan is FLAT_PROOF_GAP (relative) faster.
FLAT_PROOF_WINDOW = 0.05
FLAT_PROOF_FIRST_PASSES = 2
FLAT_PROOF_PASSES = 32
FLAT_ROWS_BUDGET = 5e7
FLAT_ROW_REACH = 2.0
FLAT_ROW_NEIGHBOURS = 0.5
FLAT_PROOF_GAP = 1e-8


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
    lower_bound_s: Optional[float] = None  # not exact: a time no plan beats (relaxation.py), if known


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


def _affordable_cut_points(hierarchy: Hierarchy, options: PartitionOptions, solves: Optional[Sequence[int]] = None) -> int:
    low, high = 2, 1 << 20
    while low < high:  # largest S with dp_work(S) <= budget
        mid = (low + high + 1) // 2
        if dp_work(mid, hierarchy, options, solves) <= AUTO_WORK_BUDGET:
            low = mid
        else:
            high = mid - 1
    return low


def choose_states(work: Workload, hierarchy: Hierarchy, options: PartitionOptions) -> States:
    """The state space an explicit `options.cuts` asks for (not "auto": see `solve_auto`)."""
    if options.cuts == "topological" or options.worker_speeds is not None:
        return prefix_states(work, options.max_cut_points)
    if options.cuts == "antichain":
        return antichain_states(work)
    if options.cuts == "all":
        return ideal_states(work)
    raise PlanError(f"choose_states does not pick cuts={options.cuts!r}; use solve_auto")


def solve_auto(work: Workload, hierarchy: Hierarchy, options: PartitionOptions) -> Solution:
    """PipeDream's antichain DP when affordable; else an exact bounded solve (module doc), at the best
    plan's time or below it; else the best plan found (topological cut points or the solve below),
    marked inexact with a lower bound."""
    if options.worker_speeds is not None:
        _check_speed_count(options, hierarchy)
        limit = options.max_cut_points
        if limit is None and len(hierarchy.levels) > 1:
            # Inner levels are cubic in the cut points and solved once per speed profile: take as many
            # cut points as the budget allows for the real profiles, unless that leaves too few (then
            # `solve` plans with one profile per level).
            limit = _affordable_cut_points(hierarchy, options, _profile_counts(options.worker_speeds, hierarchy))
            if limit < min(work.num_nodes, QUICK_CUT_POINTS):
                limit = _affordable_cut_points(hierarchy, options)
        return solve(prefix_states(work, limit), hierarchy, options)
    affordable = _affordable_cut_points(hierarchy, options)
    try:
        small = enumerate_antichains(work, max_states=min(options.max_antichain_states, affordable, states_module.MAX_DP_STATES))
    except InfeasibleError:
        small = None  # more states than PipeDream's DP can take here
    if small is not None:
        return solve_antichains(work, finish_antichains(work, small), hierarchy, options)
    # An upper bound first: a plan over a few topological cut points (all of them on the straight
    # one-level fast path), then the optimum over every prefix, bounded by it.
    fast_path = options.straight_pipeline and len(hierarchy.levels) == 1
    limit = options.max_cut_points or (None if fast_path else affordable)
    quick = limit if fast_path else min(limit or work.num_nodes, QUICK_CUT_POINTS)
    upper = replace(solve(prefix_states(work, quick), hierarchy, options), exact=False)
    if not math.isfinite(upper.time_s) and quick != limit:
        upper = replace(solve(prefix_states(work, limit), hierarchy, options), exact=False)
    if not math.isfinite(upper.time_s):
        return upper
    prefixes_fit = True
    if options.max_cut_points is None:
        over_prefixes = bounded_solve(work, hierarchy, options, cut_union(work, None), upper.time_s)
        prefixes_fit = over_prefixes is not None
        upper = _better(upper, over_prefixes)
    # The union with the antichains keeps a superset under the same bound: hopeless if prefixes alone are.
    exact, found, union = None, None, None
    if prefixes_fit:
        found = _enumerate_or_none(work)  # None: more than ENUMERATION_LIMIT states, the warning says so
        if found is not None:
            union = cut_union(work, found)
            # The estimate skips the crossing bytes of thousands of cuts when the solve is not cheap: then the
            # solve below the best time, in growing steps, usually finds the optimum sooner.
            if estimated_bounded_work(union, hierarchy, options, upper.time_s) <= BELOW_BUDGETS[0]:
                exact = bounded_solve(work, hierarchy, options, union, upper.time_s)
    if exact is not None:
        return _better(upper, exact)
    if found is None and not prefixes_fit:  # a relaxed bound needs them; a cheap try only
        found = _enumerate_or_none(work, MAX_RELAXED_STATES)
        union = None if found is None else cut_union(work, found)
    flat = flat_search(work, hierarchy, options, union, upper)
    if (flat is None or flat[0].time_s >= upper.time_s) and upper.states.kind != "topological-bounded" and quick != limit:
        upper = _better(upper, replace(solve(prefix_states(work, limit), hierarchy, options), exact=False))
    if flat is not None:
        upper = _better(upper, flat[0])
        if upper.exact:
            return upper
    searched = (
        "the cuts of plans with unreplicated outermost stages (a one-pass search) and a few prefixes"
        if upper.states.kind == "flattened"
        else f"{upper.states.num_states if upper.states.kind == 'topological-coarse' else 'all'} prefixes of one topological order"
    )
    if union is not None:
        lower = flat[1] if flat is not None and flat[1] is not None else relaxed_bound(work, hierarchy, options, union, upper.time_s) or 0.0
        lower = max(lower, float(union.compute.max()) / hierarchy.num_workers)
        below = solve_below(work, hierarchy, options, union, upper, lower)
        if below.exact:
            return below
        if below.states.kind == "bounded":
            searched = f"{below.states.num_states} antichain and prefix cuts a bounded solve below the best time kept"
        upper = below
    logger.warning(
        "%s on %d workers: too many cut states for an exact solve; this plan is the best over %s "
        "(not proven optimal; plan.extra['exact'] is false)",
        f"{len(found)} antichain states" if found is not None
        else "the bound keeps too many topological cut points" if not prefixes_fit
        else f"more than {ENUMERATION_LIMIT} antichain states",
        hierarchy.num_workers, searched,
    )
    return upper


def estimated_bounded_work(union: CutUnion, hierarchy: Hierarchy, options: PartitionOptions, upper_bound: float) -> float:
    """`bounded_work` of a bounded solve over `union` at `upper_bound`, from compute alone (transfers only
    prune more) and without the crossing bytes of every cut: milliseconds for 200,000 cuts."""
    total = float(union.compute.max())
    maybe = boundary_states(union.compute, total, hierarchy.num_workers, 1, upper_bound)
    if float(maybe.sum()) ** 2 / 2 > AUTO_WORK_BUDGET:
        return math.inf
    compute = np.append(np.sort(union.compute[maybe]), total)  # states are solved in size order: close enough
    bounds = level_bounds(compute, np.zeros(len(compute)), hierarchy, upper_bound, None)
    kept = bounds.kept_states()
    return bounded_plan(compute[kept], bounds.restricted(kept), hierarchy, options)[0]


def largest_affordable_bound(
    union: CutUnion, hierarchy: Hierarchy, options: PartitionOptions, low: float, high: float, budget: float,
) -> Optional[float]:
    """The largest time in [low, high] (to 0.01%) whose bounded solve over `union` is estimated to fit
    `budget`; None when not even `low` does."""
    def fits(bound: float) -> bool:
        return estimated_bounded_work(union, hierarchy, options, bound) <= budget

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
    budgets allow (BELOW_BUDGETS: the work grows steeply with `T`, and the optimum is often close above
    the lower bound). Each keeps every plan taking at most `T`: if it finds one, that is the optimum
    over `union` (exact); if not, every plan takes more than `T`, the next lower bound, and what it
    found (a real plan) replaces `upper` when faster. Returns the plan with `lower_bound_s` set unless
    exact; `upper` must be a plan (finite time)."""
    if not math.isfinite(upper.time_s):
        raise PlanError("solve_below needs a plan to improve on (a finite upper time)")
    best, proven = upper, lower
    for budget in BELOW_BUDGETS:
        bound = largest_affordable_bound(union, hierarchy, options, proven, best.time_s, budget)
        found = None if bound is None or bound <= proven else bounded_solve(work, hierarchy, options, union, bound)
        if found is None:
            continue
        if found.time_s <= bound:
            return found
        proven = bound
        best = _better(best, replace(found, exact=False))
    return replace(best, exact=False, lower_bound_s=proven)


def solve_antichains(work: Workload, states: States, hierarchy: Hierarchy, options: PartitionOptions) -> Solution:
    """`solve` over PipeDream's states, the same optimum and plan; on a hierarchy, first bounded by a
    quick prefix plan's time (`bounds.py`: each level solves only the rows the next level can start at
    and splits only where a plan within that time can). The full DP runs when the bound saves less than
    half of it, or when no antichain plan is within it (the prefixes found a cut PipeDream misses)."""
    full_work = dp_work(states.num_states, hierarchy, options)
    if len(hierarchy.levels) == 1 or full_work < PRUNE_MIN_WORK:
        return solve(states, hierarchy, options)
    upper = solve(prefix_states(work, QUICK_ANTICHAIN_CUT_POINTS), hierarchy, options).time_s
    if math.isfinite(upper):
        bounds = level_bounds(states.compute, states.output, hierarchy, upper, options.activation_compression_ratio)
        if bounded_plan(states.compute, bounds, hierarchy, options)[0] < full_work / 2:
            pruned = solve(states, hierarchy, options, bounds)
            if pruned.time_s <= upper * (1 + ROUNDING):
                return pruned
    return solve(states, hierarchy, options)


def _enumerate_or_none(work: Workload, limit: Optional[int] = None) -> Optional[Antichains]:
    try:
        return enumerate_antichains(work, max_states=limit or ENUMERATION_LIMIT)
    except InfeasibleError:
        return None


def _better(current: Solution, candidate: Optional[Solution]) -> Solution:
    """`candidate` unless it is missing or slower; solves over more cuts sum in another order, so a
    tie within the last bits goes to the candidate (it covers the current one's cuts)."""
    if candidate is None or not candidate.time_s <= current.time_s * (1 + 1e-12):
        return current
    return candidate


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


def cut_union(work: Workload, antichains: Optional[Antichains]) -> CutUnion:
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
    if float(maybe.sum()) ** 2 / 2 > AUTO_WORK_BUDGET:  # even one level on two machines touches S^2 / 2
        return None
    costs = union.costs(work, maybe)
    bounds = level_bounds(costs.compute, costs.output, hierarchy, upper_bound, options.activation_compression_ratio)
    kept = bounds.kept_states()
    costs, bounds = costs.subset(kept), bounds.restricted(kept)
    estimate, over_cells = bounded_plan(costs.compute, bounds, hierarchy, options)
    if estimate > AUTO_WORK_BUDGET:
        return None
    if any(over_cells):  # fewer states: a smaller ancestor matrix and tables
        used = used_states(costs.compute, bounds, hierarchy, options, over_cells)
        costs, bounds = costs.subset(used), bounds.restricted(used)
    states = states_from_costs(costs, "bounded" if union.with_antichains else "topological-bounded")
    solution = solve(states, hierarchy, options, bounds)
    return replace(solution, exact=union.with_antichains, states_considered=len(union.downsets))


def flat_search(
    work: Workload, hierarchy: Hierarchy, options: PartitionOptions, union: Optional[CutUnion], upper: Solution,
) -> Optional[tuple[Solution, Optional[float]]]:
    """On a hierarchy without worker speeds, when the exact solves are out of reach: plans whose
    outermost stages are unreplicated, found in one pass over the cuts of `union` that can bound a
    next-level stage within `upper`'s time (`flattened.py`), with their replicas and times set by
    the DP over their cuts; and the flattened relaxation's lower bound. On three levels, once the plan is
    close to that bound, the relaxation with exact inner rows (`inner_rows.py`) may prove it optimal
    (`exact`), or find a better one. Returns (the best plan found, or `upper`; a time no plan beats, None
    when `union` is missing or has too many such cuts and only the prefixes were searched), or None when
    it does not apply or even the prefixes are too many."""
    if len(hierarchy.levels) < 2 or options.worker_speeds is not None:
        return None
    union = union or cut_union(work, None)
    # Boundaries of next-level stages fall after whole machines; on three levels the relaxation also
    # splits a machine's range among its workers (`flattened.py`'s chains), anywhere.
    unit = 1 if len(hierarchy.levels) == 3 else hierarchy.num_workers // math.prod(level.num_machines for level in hierarchy.levels[-2:])
    keep = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, unit, upper.time_s)
    bounding = union.with_antichains and int(keep.sum()) <= MAX_FLAT_STATES
    if not bounding:  # without the antichains, or too many: plans over the prefixes only (no bound)
        union = cut_union(work, None)
        keep = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, unit, upper.time_s)
        if int(keep.sum()) > MAX_FLAT_STATES:
            return None
    flat = flat_states(union.costs(work, keep), hierarchy, upper.time_s, max_pairs=FLAT_PASS_BUDGET)
    if flat is None:
        return None
    best, cuts = upper, set()

    def plan_within(time_s: float) -> bool:
        nonlocal best
        found = flat_plan_cuts(flat, hierarchy, options, time_s)
        if found is None:
            return False
        cuts.update(found)
        candidate = solve(cut_states(work, list(cuts), "flattened"), hierarchy, options)
        best = _better(best, replace(candidate, exact=False))
        return True

    def proven(most_passes: int) -> bool:
        """Whether no plan is FLAT_PROOF_GAP faster than `best` (the relaxation with exact rows has none),
        within `most_passes` proof passes in all; its exact plans on the way are real ones and replace `best`."""
        nonlocal best, proof_passes
        target, found = best.time_s * (1 - FLAT_PROOF_GAP), None
        while proof_passes < most_passes:
            proof_passes += 1
            found = flat_witness(flat, hierarchy, options, target, rows, found)
            if found is None:
                return True
            stages = found.stages
            missing = [(start, end) for start, end in stages if not rows.covers(start, end)]
            if missing and rows.pairs < FLAT_ROWS_BUDGET:
                for start, end in missing:
                    # A replicated stage that opens an outer one may end anywhere up to a whole machine's compute.
                    span = flat.compute[end] - (flat.compute[start] if start >= 0 else 0.0)
                    replicated = span > rows.workers * target and start in found.may_open
                    rows.add(start, math.inf if replicated else FLAT_ROW_REACH * span)
                    if start >= 0 and not replicated:
                        near = np.flatnonzero(np.abs(flat.compute - flat.compute[start]) <= FLAT_ROW_NEIGHBOURS * target)
                        for other in near[included(flat.inclusion, np.full(len(near), end), near)].tolist():
                            if not rows.covers(other, end):
                                rows.add(other, FLAT_ROW_REACH * (flat.compute[end] - flat.compute[other]))
                continue
            if missing or not found.complete:
                return False
            # Every stage exact: a real plan within the target, with its inner cuts from the rows.
            own = {flat.members[end] for _, end in stages}
            own.update(flat.members[k] for start, end in stages for k in rows.inner_cuts(start, end))
            candidate = solve(cut_states(work, list(own), "flattened"), hierarchy, options)
            best = _better(best, replace(candidate, exact=False))
            if best.time_s > target:  # the DP's rules differ from the relaxation's here: give up
                return False
            target = best.time_s * (1 - FLAT_PROOF_GAP)
        return False

    rows = inner_rows(flat, hierarchy, options) if bounding else None
    exact, proof_passes = False, 0

    # As many passes of each kind as the budget allows (at least one: `flat_states` checked).
    passes = min(FLAT_MOST_PASSES, int(FLAT_PASS_BUDGET / max(flat.pairs, 1)))
    # The relaxation's optimum is usually a few percent below the plan: step down from it in doubling
    # steps until a probe fails, then bisect.
    lower, high = float(union.compute.max()) / hierarchy.num_workers, upper.time_s
    step, stepping = FLAT_BOUND_FIRST_STEP, True
    for _ in range(passes if bounding else 0):
        if high - lower <= FLAT_TOLERANCE * lower:
            break
        probe = max(high * (1 - step), (lower + high) / 2) if stepping else (lower + high) / 2
        if flat_feasible(flat, hierarchy, options, probe):
            high, step = probe, 2 * step
        else:
            lower, stepping = probe, False
    # Heuristic plans get better the tighter their time: from the relaxation's up in doubling steps until
    # one is found, then bisect. (Not on a straight pipeline: it wants one stage per worker, the
    # heuristic as few as fit and the inside data-parallel.)
    failed, found, probe, step = lower, math.inf, high, FLAT_FIRST_STEP
    for _ in range(0 if options.straight_pipeline else passes):
        if plan_within(probe):
            found = min(probe, best.time_s)
            if rows is not None and found - lower <= FLAT_PROOF_WINDOW * lower:
                exact = proven(min(FLAT_PROOF_FIRST_PASSES, FLAT_PROOF_PASSES))
                if exact:
                    break
        else:
            failed = probe
        if found - failed <= FLAT_TOLERANCE * failed or failed >= upper.time_s:
            break
        probe = (failed + found) / 2 if math.isfinite(found) else min(failed * (1 + step), upper.time_s)
        step *= 2
    if rows is not None and not exact and best.time_s - lower <= FLAT_PROOF_WINDOW * lower:
        exact = proven(FLAT_PROOF_PASSES)  # the rest of the passes, at the heuristic's best plan
    if exact:
        lower = best.time_s * (1 - FLAT_PROOF_GAP)
    return (replace(best, exact=True) if exact else best), lower if bounding else None


def inner_rows(flat: FlatStates, hierarchy: Hierarchy, options: PartitionOptions) -> Optional[InnerRows]:
    """Exact inner rows for the proof, on three levels (where the relaxation sees the servers' own
    workers) without a straight pipeline (one stage per worker leaves no inner plan to choose). A row
    reaches at most a pod's workers' compute at the states' time: the inclusions the pass keeps cover
    every split of such a range (a missing one would make a row too slow, and the proof wrong)."""
    if flat.inclusion is None or options.straight_pipeline:
        return None
    levels = hierarchy.levels
    return InnerRows(flat, levels[0], options, levels[0].num_machines * levels[1].num_machines * flat.max_time_s)


def relaxed_bound(
    work: Workload, hierarchy: Hierarchy, options: PartitionOptions, union: CutUnion, upper_bound: float,
) -> Optional[float]:
    """`relaxation.relaxed_lower_bound` over the cuts of `union` that can bound an outermost stage of
    a plan taking at most `upper_bound`; None with worker speeds or when too many of them remain."""
    if options.worker_speeds is not None:
        return None
    group = hierarchy.num_workers // hierarchy.levels[-1].num_machines
    outer = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, group, upper_bound)
    if int(outer.sum()) > MAX_RELAXED_STATES:
        return None
    return relaxed_lower_bound(union.costs(work, outer), hierarchy, options, upper_bound)


def solve(
    states: States, hierarchy: Hierarchy, options: PartitionOptions, bounds: Optional[LevelBounds] = None,
    use_cells: bool = True,
) -> Solution:
    """Run the DP over every level and reconstruct the innermost parts (replicas multiplied out).

    With `bounds`, each level solves only the rows where the next level may start a stage and splits
    only at its allowed states, and where it pays (`cells.bounded_plan`, unless `use_cells` is false)
    only the cells a plan within the bound's time can use: exact for plans within that time.
    """
    memory = hierarchy.memory_bytes if options.use_memory_constraint else None
    levels = hierarchy.levels
    _check_speed_count(options, hierarchy)
    if (
        len(levels) == 1
        and options.straight_pipeline
        and states.kind.startswith("topological")
        and bounds is None
    ):
        value, parts = straight_partition(
            states, options.worker_speeds or (1.0,) * levels[0].num_machines, levels[0].bandwidth,
            options.activation_compression_ratio, options.use_fewer_machines, memory, options.memory_model,
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
        counts = _profile_counts(options.worker_speeds, hierarchy)
        if dp_work(states.num_states, hierarchy, options, counts) <= max(AUTO_WORK_BUDGET, dp_work(states.num_states, hierarchy, options)):
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
        table_rows = all_rows(states.num_states) if bounds is None else row_states(bounds, 0)
    sums = (states.compute, states.activation, states.parameters)
    compute = range_table(states.compute, strict, table_rows)
    all_tables: list[LevelTables] = []
    over_cells = (False,) * len(levels)
    if bounds is not None and use_cells:
        over_cells = bounded_plan(states.compute, bounds, hierarchy, options)[1]
    within = 1
    for number, level in enumerate(levels):
        activation = range_table(states.activation, strict, table_rows)
        parameters = range_table(states.parameters, strict, table_rows)
        limits = {}
        if bounds is not None:
            starts = row_states(bounds, number)
            limits = dict(solve_rows=np.searchsorted(table_rows, starts), splittable=bounds.splittable[number])
            if over_cells[number]:
                limits["cells"] = cell_mask(
                    states.compute, starts, number, hierarchy, bounds.upper_bound_s, options.straight_pipeline,
                )
        tables = solve_level(
            compute, activation, parameters, states.output, states.pred_mask,
            level.num_machines, within, level.bandwidth, final_level=number == len(levels) - 1,
            straight_pipeline=options.straight_pipeline, use_fewer_machines=options.use_fewer_machines,
            activation_compression_ratio=options.activation_compression_ratio,
            memory_limit=memory, memory_model=options.memory_model,
            cumulative=sums if one_level or (number == 0 and bounds is not None) else None,
            row_states=table_rows, worker_speeds=speeds, **limits,
        )
        # The best time of each range on all of this level's machines is its compute time one level up.
        compute = tables.best[:, :, -1].copy()
        table_rows = tables.row_states
        within = level.num_machines
        all_tables.append(tables)
    return _reconstruct(states, hierarchy, lambda level, _: all_tables[level], speeds)


def _check_speed_count(options: PartitionOptions, hierarchy: Hierarchy) -> None:
    if options.worker_speeds is not None and len(options.worker_speeds) != hierarchy.num_workers:
        raise PlanError(
            f"worker_speeds has {len(options.worker_speeds)} value(s) but the hierarchy "
            f"{[level.num_machines for level in hierarchy.levels]} has {hierarchy.num_workers} worker(s); "
            "give one speed per worker"
        )


def _speed_array(worker_speeds: Sequence[float], hierarchy: Hierarchy) -> np.ndarray:
    """Speeds as [outermost machine, ..., innermost worker]: ranks number workers innermost first."""
    return np.array(worker_speeds, dtype=np.float64).reshape([level.num_machines for level in hierarchy.levels[::-1]])


def _profile_counts(worker_speeds: Sequence[float], hierarchy: Hierarchy) -> list[int]:
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
                memory_limit=memory, memory_model=options.memory_model, row_states=rows,
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


def _assign_nodes(graph: Graph, work: Workload, solution: Solution) -> dict[str, int]:
    """PipeDream's rule: stage s gets the not-yet-placed nodes of P(end state of s)."""
    stage_of: dict[str, int] = {}
    placed = 0
    for stage, part in enumerate(solution.parts):
        new = solution.states.members[part.end - 1] & ~placed
        placed |= new
        while new:
            low = new & -new
            stage_of[work.node_ids[low.bit_length() - 1]] = stage
            new ^= low
    for node_id in work.node_ids:  # cannot happen for a complete state space; keep plans total anyway
        stage_of.setdefault(node_id, len(solution.parts) - 1)
    for node_id in work.inputs:
        stage_of[node_id] = 0
    for node_id in work.dropped:
        producers = graph.predecessors[node_id]
        stage_of[node_id] = max((stage_of.get(p, 0) for p in producers), default=0)
    return stage_of


def _infeasible_message(graph: Graph, work: Workload, hierarchy: Hierarchy, options: PartitionOptions, states: States) -> str:
    workers = hierarchy.num_workers
    if options.use_memory_constraint:
        # The bisection solves ~15 times: over many states, search a few cut points (an upper estimate).
        thorough = states.num_states <= QUICK_CUT_POINTS or options.worker_speeds is not None
        search = states if thorough else prefix_states(work, QUICK_CUT_POINTS)
        free = solve(search, hierarchy, replace(options, use_memory_constraint=False))
        if math.isfinite(free.time_s):
            need = minimum_memory(search, hierarchy, options, _peak_memory(free.parts, search, workers, options.memory_model))
            found = (
                f"the smallest memory any plan fits in is about {need:.4g} bytes per worker"
                if thorough else f"a plan over {search.num_states} cut points fits in {need:.4g} bytes per worker"
            )
            return (
                f"no partition fits {hierarchy.memory_bytes:.4g} bytes per worker (memory model {options.memory_model!r}); "
                f"{found}: raise -s/--memory_size to at least that, or add workers"
            )
    if options.straight_pipeline and workers > states.num_states and not options.use_fewer_machines:
        return (
            f"more stages than nodes: a straight pipeline on {workers} workers needs {workers} stages but the graph "
            f"has only {states.num_states} cut point(s) ({len(graph)} nodes); use fewer workers or --use_fewer_machines"
        )
    return f"no feasible partition of {len(graph)} nodes on {workers} workers with {options}"


def minimum_memory(states: States, hierarchy: Hierarchy, options: PartitionOptions, feasible: float) -> float:
    """Bisect the per-worker memory between the (infeasible) limit and a feasible amount, to 0.1%."""
    low, high = hierarchy.memory_bytes, max(feasible, hierarchy.memory_bytes)
    for _ in range(24):
        if high - low <= 1e-3 * high:
            break
        middle = (low + high) / 2
        trial = replace(hierarchy, memory_bytes=middle)
        if math.isfinite(solve(states, trial, options).time_s):
            high = middle
        else:
            low = middle
    return high


def _peak_memory(parts: tuple[Part, ...], states: States, workers: int, memory_model: str) -> float:
    peak, before = 0.0, 0
    for part in parts:
        low = part.start - 1
        bytes_ = (states.activation[part.end - 1] + states.parameters[part.end - 1]) - (
            states.activation[low] + states.parameters[low] if low >= 0 else 0.0
        )
        peak = max(peak, stash_factor(memory_model, workers, before, part.replicas) * bytes_)
        before += part.replicas
    return peak


def data_parallel_time(states: States, hierarchy: Hierarchy) -> float:
    """PipeDream's data-parallel estimate: the whole model replicated at every level."""
    return float(data_parallel_seconds(float(states.compute[-1]), float(states.parameters[-1]), hierarchy.levels))


def partition(graph: Graph, hierarchy: Hierarchy, options: PartitionOptions = PartitionOptions()) -> Plan:
    """Partition `graph` into pipeline stages on `hierarchy`; the plan covers every node of the graph.

    Raises `InfeasibleError` when nothing fits (memory, or more stages than nodes) and `PlanError`
    for inconsistent arguments.
    """
    started = time.perf_counter()
    work = preprocess(graph)
    if options.cuts == "auto":
        solution = solve_auto(work, hierarchy, options)
    else:
        solution = solve(choose_states(work, hierarchy, options), hierarchy, options)
    if not math.isfinite(solution.time_s):
        raise InfeasibleError(_infeasible_message(graph, work, hierarchy, options, solution.states))
    if not solution.exact and options.worker_speeds is None:
        nodes = node_share_bound(np.array(work.compute_s), np.array(work.parameters), hierarchy, options.straight_pipeline)
        solution = replace(solution, lower_bound_s=max(solution.lower_bound_s or 0.0, nodes))
    stage_of = _assign_nodes(graph, work, solution)
    elapsed = time.perf_counter() - started
    return build_plan(graph, hierarchy, options, solution, stage_of, elapsed)


def build_plan(
    graph: Graph, hierarchy: Hierarchy, options: PartitionOptions, solution: Solution,
    stage_of: dict[str, int], elapsed: float,
) -> Plan:
    num_stages = len(solution.parts)
    costs = stage_costs(graph, stage_of, num_stages)
    workers = hierarchy.num_workers
    levels = hierarchy.levels
    ratio = options.activation_compression_ratio or 1.0
    level_replicas = solution.level_replicas or tuple((part.replicas,) for part in solution.parts)
    boundary_levels = solution.boundary_levels or (0,) * (num_stages - 1)
    stages = []
    before = 0
    order = graph.topological_order
    for index, (part, cost) in enumerate(zip(solution.parts, costs)):
        r = part.replicas
        replicas = level_replicas[index]
        # PipeDream's terms, each at its level: all-reduce of the stage's weights among its replicas
        # there (divided by the machines inside), activations over the level that splits the boundary.
        transfers, within = [0.0], 1
        for level, count in zip(levels, replicas):
            transfers.append(4 * (count - 1) * cost.parameter_bytes / (level.bandwidth * count) / within)
            within *= level.num_machines
        if index > 0:
            level = boundary_levels[index - 1]
            transfers.append(2.0 * cost.input_bytes / (levels[level].bandwidth * replicas[level]) / ratio)
        if index < num_stages - 1:
            level = boundary_levels[index]
            transfers.append(2.0 * cost.output_bytes / (levels[level].bandwidth * replicas[level]) / ratio)
        stages.append(
            StagePlan(
                stage_id=index,
                node_ids=tuple(n for n in order if stage_of[n] == index),
                num_replicas=r,
                compute_s=cost.compute_s,
                communication_s=max(transfers),
                memory_bytes=stash_factor(options.memory_model, workers, before, r)
                * (cost.activation_bytes + cost.parameter_bytes),
                ranks=solution.part_ranks[index] if solution.part_ranks else (),
            )
        )
        before += r
    extra = {
        "cuts": solution.states.kind,
        "num_states": solution.states.num_states,
        "exact": solution.exact,
        "data_parallel_time_s": data_parallel_time(solution.states, hierarchy),
        "bandwidths": [level.bandwidth for level in hierarchy.levels],
        "memory_model": options.memory_model,
        "workers_unused": workers - before,
    }
    if solution.states_considered:
        extra["states_considered"] = solution.states_considered
    if not solution.exact:
        # No plan beats perfect balance without any communication: how far from optimal this can be
        # (a worker of speed s does s times its share).
        capacity = sum(options.worker_speeds) if options.worker_speeds is not None else workers
        extra["lower_bound_s"] = max(float(solution.states.compute[-1]) / capacity, solution.lower_bound_s or 0.0)
    if options.worker_speeds is not None:
        extra["worker_speeds"] = list(options.worker_speeds)
        if solution.speeds_simplified:
            extra["worker_speeds_simplified"] = True
    return Plan(
        stages=tuple(stages),
        time_per_minibatch_s=solution.time_s,
        single_machine_time_s=float(solution.states.compute[-1]),
        optimizer_seconds=elapsed,
        num_machines=tuple(level.num_machines for level in hierarchy.levels),
        extra=extra,
    ).with_default_ranks()
