"""`search_auto`: what `cuts="auto"` does when PipeDream's antichain DP is out of reach (module doc of
`optimizer/search/__init__.py`): bounded exact solves, then the flattened search, then a bounded solve
below the best time; the best plan found is returned, `exact` only when proven optimal.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.search.bounded import (
    bounded_solve, cut_union, enumerate_or_none, estimated_bounded_work, relaxed_bound, solve_below,
)
from model_parallel.optimizer.solve import Solution, better, solve
from model_parallel.optimizer.states import Workload, prefix_states

logger = logging.getLogger(__name__)


def search_auto(work: Workload, hierarchy: Hierarchy, options: PartitionOptions, affordable: int) -> Solution:
    """The best plan over PipeDream's antichains and every topological prefix that the budgets of
    `options.tuning` allow (`affordable`: cut points a plain DP may take); `exact` when proven optimal,
    else with `lower_bound_s`."""
    tuning = options.tuning
    # An upper bound first: a plan over a few topological cut points (all of them on the straight
    # one-level fast path), then the optimum over every prefix, bounded by it.
    fast_path = options.straight_pipeline and len(hierarchy.levels) == 1
    limit = options.max_cut_points or (None if fast_path else affordable)
    quick = limit if fast_path else min(limit or work.num_nodes, options.tuning.quick_cut_points)
    upper = replace(solve(prefix_states(work, quick), hierarchy, options), exact=False)
    if not math.isfinite(upper.time_s) and quick != limit:
        upper = replace(solve(prefix_states(work, limit), hierarchy, options), exact=False)
    if not math.isfinite(upper.time_s):
        return upper
    prefixes_fit = True
    if options.max_cut_points is None:
        over_prefixes = bounded_solve(work, hierarchy, options, cut_union(work, None), upper.time_s)
        prefixes_fit = over_prefixes is not None
        upper = better(upper, over_prefixes)
    # The union with the antichains keeps a superset under the same bound: hopeless if prefixes alone are.
    exact, found, union = None, None, None
    if prefixes_fit:
        found = enumerate_or_none(work, options.tuning.enumeration_limit)  # None: too many, the warning says so
        if found is not None:
            union = cut_union(work, found)
            # The estimate skips the crossing bytes of thousands of cuts when the solve is not cheap: then the
            # solve below the best time, in growing steps, usually finds the optimum sooner.
            if estimated_bounded_work(union, hierarchy, options, upper.time_s, True) <= tuning.below_budgets[0]:
                exact = bounded_solve(work, hierarchy, options, union, upper.time_s)
    if exact is not None:
        return better(upper, exact)
    if found is None and prefixes_fit:
        # Too many antichains for an exact solve: PipeDream's own walk from the main source alone still
        # offers cuts no prefix order has (side branches beside the main one). Some cuts, not all: the
        # plan is a candidate, never exact, and these cuts bound nothing below it.
        limit = min(options.tuning.partial_walk_states, options.tuning.enumeration_limit)  # one source: the whole walk
        partial = enumerate_or_none(work, limit, main_source_only=True)
        if partial is not None:
            candidate = bounded_solve(work, hierarchy, options, cut_union(work, partial), upper.time_s)
            if candidate is not None:
                upper = better(upper, replace(candidate, exact=False))
    if found is None and not prefixes_fit:  # a relaxed bound needs them; a cheap try only
        found = enumerate_or_none(work, options.tuning.max_relaxed_states)
        union = None if found is None else cut_union(work, found)
    # numba (when installed) loads with the flattened search, on its first use here: importing the
    # optimizer never pays for it, nor sets its process-wide threading layer; nor does one level, where
    # the flattened search does not apply (the import alone took 0.3-1.5 s).
    flat = None
    if len(hierarchy.levels) > 1:
        from model_parallel.optimizer.search import jit
        from model_parallel.optimizer.search.flat_search import flat_search

        flat = flat_search(work, hierarchy, options, union, upper)
    if flat is None and len(hierarchy.levels) > 1 and not jit.AVAILABLE:
        logger.info("numba is not installed: the search for plans with unreplicated outermost stages ran only on small "
                    "problems; pip install 'model_parallel[search]' for the rest")
    # Every prefix, unbounded (seconds on a few hundred nodes), when nothing better was found: `affordable`
    # already holds its work to `tuning.work_budget` elements (or the caller's `max_cut_points`).
    if (flat is None or flat[0].time_s >= upper.time_s) and upper.states.kind != "topological-bounded" and quick != limit:
        upper = better(upper, replace(solve(prefix_states(work, limit), hierarchy, options), exact=False))
    if flat is not None:
        upper = better(upper, flat[0])
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
        else f"more than {options.tuning.enumeration_limit} antichain states",
        hierarchy.num_workers, searched,
    )
    return upper
