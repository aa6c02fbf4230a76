"""The search where no exact solve fits on a hierarchy: plans whose outermost stages are unreplicated.

One pass over the cuts (`flattened.py`, compiled by numba when installed: `flat_kernel.py`) finds such
plans and, relaxed, a lower bound; on three levels exact inner rows (`inner_rows.py`) may prove the plan
optimal. See docs/optimizer.md for what it finds and what it costs.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search import jit
from model_parallel.optimizer.search.bounded import CutUnion, cut_union
from model_parallel.optimizer.search.bounds import boundary_states
from model_parallel.optimizer.search.flat_kernel import FlatStates, included
from model_parallel.optimizer.search.flattened import flat_feasible, flat_plan_cuts, flat_states, flat_witness
from model_parallel.optimizer.search.inner_rows import InnerRows
from model_parallel.optimizer.solve import Solution, better, solve
from model_parallel.optimizer.states import Workload, cut_states


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
    tuning = options.tuning
    union = union or cut_union(work, None)
    # Boundaries of next-level stages fall after whole machines; on three levels the relaxation also
    # splits a machine's range among its workers (`flattened.py`'s chains), anywhere.
    unit = 1 if len(hierarchy.levels) == 3 else hierarchy.num_workers // math.prod(level.num_machines for level in hierarchy.levels[-2:])
    keep = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, unit, upper.time_s)
    bounding = union.with_antichains and int(keep.sum()) <= tuning.max_flat_states
    if not bounding:  # without the antichains, or too many: plans over the prefixes only (no bound)
        union = cut_union(work, None)
        keep = boundary_states(union.compute, float(union.compute.max()), hierarchy.num_workers, unit, upper.time_s)
        if int(keep.sum()) > tuning.max_flat_states:
            return None
    flat = flat_states(union.costs(work, keep), hierarchy, upper.time_s, max_pairs=tuning.flat_pass_budget)
    if flat is None or (not jit.AVAILABLE and flat.pairs > tuning.flat_python_pairs):
        return None  # without numba a pass runs as plain Python: only small ones
    best, cuts = upper, set()

    def plan_within(time_s: float) -> bool:
        nonlocal best
        found = flat_plan_cuts(flat, hierarchy, options, time_s)
        if found is None:
            return False
        cuts.update(found)
        candidate = solve(cut_states(work, list(cuts), "flattened"), hierarchy, options)
        best = better(best, replace(candidate, exact=False))
        return True

    def proven(most_passes: int) -> bool:
        """Whether no plan is tuning.flat_proof_gap faster than `best` (the relaxation with exact rows has none),
        within `most_passes` proof passes in all; its exact plans on the way are real ones and replace `best`."""
        nonlocal best, proof_passes
        target, found = best.time_s * (1 - tuning.flat_proof_gap), None
        while proof_passes < most_passes:
            proof_passes += 1
            found = flat_witness(flat, hierarchy, options, target, rows, found)
            if found is None:
                return True
            stages = found.stages
            missing = [(start, end) for start, end in stages if not rows.covers(start, end)]
            if missing and rows.pairs < tuning.flat_rows_budget:
                for start, end in missing:
                    # A replicated stage that opens an outer one may end anywhere up to a whole machine's compute.
                    span = flat.compute[end] - (flat.compute[start] if start >= 0 else 0.0)
                    replicated = span > rows.workers * target and start in found.may_open
                    rows.add(start, math.inf if replicated else tuning.flat_row_reach * span)
                    if start >= 0 and not replicated:
                        near = np.flatnonzero(np.abs(flat.compute - flat.compute[start]) <= tuning.flat_row_neighbours * target)
                        for other in near[included(flat.inclusion, np.full(len(near), end), near)].tolist():
                            if not rows.covers(other, end):
                                rows.add(other, tuning.flat_row_reach * (flat.compute[end] - flat.compute[other]))
                continue
            if missing or not found.complete:
                return False
            # Every stage exact: a real plan within the target, with its inner cuts from the rows.
            own = {flat.members[end] for _, end in stages}
            own.update(flat.members[k] for start, end in stages for k in rows.inner_cuts(start, end))
            candidate = solve(cut_states(work, list(own), "flattened"), hierarchy, options)
            best = better(best, replace(candidate, exact=False))
            if best.time_s > target:  # the DP's rules differ from the relaxation's here: give up
                return False
            target = best.time_s * (1 - tuning.flat_proof_gap)
        return False

    rows = inner_rows(flat, hierarchy, options) if bounding else None
    exact, proof_passes = False, 0

    # As many passes of each kind as the budget allows (at least one: `flat_states` checked).
    passes = min(tuning.flat_most_passes, int(tuning.flat_pass_budget / max(flat.pairs, 1)))
    # The relaxation's optimum is usually a few percent below the plan: step down from it in doubling
    # steps until a probe fails, then bisect.
    lower, high = float(union.compute.max()) / hierarchy.num_workers, upper.time_s
    step, stepping = tuning.flat_bound_first_step, True
    for _ in range(passes if bounding else 0):
        if high - lower <= tuning.flat_tolerance * lower:
            break
        probe = max(high * (1 - step), (lower + high) / 2) if stepping else (lower + high) / 2
        if flat_feasible(flat, hierarchy, options, probe):
            high, step = probe, 2 * step
        else:
            lower, stepping = probe, False
    # Heuristic plans get better the tighter their time: from the relaxation's up in doubling steps until
    # one is found, then bisect. (Not on a straight pipeline: it wants one stage per worker, the
    # heuristic as few as fit and the inside data-parallel.)
    failed, found, probe, step = lower, math.inf, high, tuning.flat_first_step
    for _ in range(0 if options.straight_pipeline else passes):
        if plan_within(probe):
            found = min(probe, best.time_s)
            if rows is not None and found - lower <= tuning.flat_proof_window * lower:
                exact = proven(min(tuning.flat_proof_first_passes, tuning.flat_proof_passes))
                if exact:
                    break
        else:
            failed = probe
        if found - failed <= tuning.flat_tolerance * failed or failed >= upper.time_s:
            break
        probe = (failed + found) / 2 if math.isfinite(found) else min(failed * (1 + step), upper.time_s)
        step *= 2
    if rows is not None and not exact and best.time_s - lower <= tuning.flat_proof_window * lower:
        exact = proven(tuning.flat_proof_passes)  # the rest of the passes, at the heuristic's best plan
    if exact:
        lower = best.time_s * (1 - tuning.flat_proof_gap)
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
