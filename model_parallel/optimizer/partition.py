"""`partition(graph, hierarchy, options) -> Plan`: PipeDream's hierarchical optimizer, exact and fast.

Pure: no I/O, no globals; the only impurity is `Plan.optimizer_seconds`, measured around the solve.
Steps: pre-process (states.py), enumerate cut states, solve each level of the hierarchy innermost
first (solve.py, dp.py), follow the recorded splits outermost first down to the stages, then place
nodes and price the stages (assemble.py, costs.py).

`cuts="auto"`: PipeDream's antichain DP when the graph has few enough antichain states; on a bigger
graph the best plan over prefixes of one topological order, marked `exact: false` with a lower bound.
A one-level straight pipeline over prefixes takes the fast path (`straight.py`). Every budget counts
states or array elements, never seconds: the same input gives the same plan on any machine at any load.
The search layers (`optimizer/search`, opt-in: `search.searched_partition`) plug in through `search`;
this module never imports them.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import ZERO_BUBBLE_SCHEDULES
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import Plan
from model_parallel.optimizer import antichains as antichains_module
from model_parallel.optimizer.assemble import assign_nodes, build_plan, infeasible_message
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.share_bound import node_share_bound
from model_parallel.optimizer.solve import Solution, affordable_cut_points, check_speed_count, profile_counts, solve
from model_parallel.optimizer.antichains import Antichains, antichain_states, enumerate_antichains, finish_antichains
from model_parallel.optimizer.states import States, Workload, ideal_states, preprocess, prefix_states

logger = logging.getLogger(__name__)

# What `cuts="auto"` runs instead of the core's solves when the search layers are opted in:
# (work, hierarchy, options, affordable cut points, PipeDream's antichains or None when too many).
SearchSolver = Callable[[Workload, Hierarchy, PartitionOptions, int, Optional[Antichains]], Solution]


def choose_states(work: Workload, hierarchy: Hierarchy, options: PartitionOptions) -> States:
    """The state space an explicit `options.cuts` asks for (not "auto": see `solve_auto`)."""
    if options.cuts == "topological" or options.worker_speeds is not None:
        return prefix_states(work, options.max_cut_points)
    if options.cuts == "antichain":
        return antichain_states(work)
    if options.cuts == "all":
        return ideal_states(work)
    raise PlanError(f"choose_states does not pick cuts={options.cuts!r}; use solve_auto")


def solve_auto(work: Workload, hierarchy: Hierarchy, options: PartitionOptions, search: Optional[SearchSolver] = None) -> Solution:
    """PipeDream's antichain DP when affordable; else the search (when given) or the best prefix plan,
    marked inexact."""
    if options.worker_speeds is not None:
        check_speed_count(options, hierarchy)
        limit = options.max_cut_points
        if limit is None and len(hierarchy.levels) > 1:
            # Inner levels are cubic in the cut points and solved once per speed profile: take as many
            # cut points as the budget allows for the real profiles, unless that leaves too few (then
            # `solve` plans with one profile per level).
            limit = affordable_cut_points(hierarchy, options, profile_counts(options.worker_speeds, hierarchy))
            if limit < min(work.num_nodes, options.tuning.quick_cut_points):
                limit = affordable_cut_points(hierarchy, options)
        return solve(prefix_states(work, limit), hierarchy, options)
    affordable = affordable_cut_points(hierarchy, options)
    try:
        small = enumerate_antichains(work, max_states=min(options.max_antichain_states, affordable, antichains_module.MAX_DP_STATES))
    except InfeasibleError:
        small = None  # more states than PipeDream's DP can take here
    if search is not None:
        return search(work, hierarchy, options, affordable, small)
    if small is not None:
        return solve(finish_antichains(work, small), hierarchy, options)
    fast_path = options.straight_pipeline and len(hierarchy.levels) == 1
    limit = options.max_cut_points or (None if fast_path else affordable)
    plan = replace(solve(prefix_states(work, limit), hierarchy, options), exact=False)
    logger.warning(
        "more than %d antichain states on %d workers: PipeDream's DP is out of reach; this plan is the best over %s "
        "prefixes of one topological order (not proven optimal; plan.extra['exact'] is false); "
        "the opt-in search (--search; model_parallel.optimizer.search.searched_partition) runs exact bounded solves",
        options.max_antichain_states, hierarchy.num_workers, plan.states.num_states,
    )
    return plan


def partition(
    graph: Graph, hierarchy: Hierarchy, options: PartitionOptions = PartitionOptions(), search: Optional[SearchSolver] = None,
) -> Plan:
    """Partition `graph` into pipeline stages on `hierarchy`; the plan covers every node of the graph.
    `search`: the search layers' solver for `cuts="auto"` (`search.searched_partition` passes it).

    Raises `InfeasibleError` when nothing fits (memory, or more stages than nodes) and `PlanError`
    for inconsistent arguments.
    """
    started = time.perf_counter()
    zero_bubble = options.footprint is not None and options.footprint.schedule in ZERO_BUBBLE_SCHEDULES
    work = preprocess(graph, options.memory_model, zero_bubble)
    if options.cuts == "auto":
        solution = solve_auto(work, hierarchy, options, search)
    else:
        solution = solve(choose_states(work, hierarchy, options), hierarchy, options)
    if not math.isfinite(solution.time_s):
        raise InfeasibleError(infeasible_message(graph, work, hierarchy, options, solution.states))
    if not solution.exact and options.worker_speeds is None:
        nodes = node_share_bound(np.array(work.compute_s), np.array(work.parameters), hierarchy, options.straight_pipeline)
        solution = replace(solution, lower_bound_s=max(solution.lower_bound_s or 0.0, nodes))
    stage_of = assign_nodes(graph, work, solution)
    elapsed = time.perf_counter() - started
    return build_plan(graph, hierarchy, options, solution, stage_of, elapsed)
