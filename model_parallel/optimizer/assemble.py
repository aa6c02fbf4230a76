"""From a `Solution` to a `Plan`: which stage each node lands in, and each stage's PipeDream costs.

Also the one-line reasons `partition` gives when no plan fits (with the memory the best plan needs).
"""
from __future__ import annotations

import math
from dataclasses import replace

from model_parallel.errors import InfeasibleError
from model_parallel.graph.core import Graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.graph.precision import precision_of
from model_parallel.optimizer.costs import data_parallel_seconds, stage_costs, stage_transfers
from model_parallel.optimizer.dp import Part
from model_parallel.optimizer.memory import (MemoryModel, footprint_parts, multipliers, offload_bytes, stage_bytes,
                                            stash_bytes)
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.solve import Solution, solve
from model_parallel.optimizer.states import States, Workload, prefix_states


def assign_nodes(graph: Graph, work: Workload, solution: Solution) -> dict[str, int]:
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


def infeasible_message(graph: Graph, work: Workload, hierarchy: Hierarchy, options: PartitionOptions, states: States) -> str:
    workers = hierarchy.num_workers
    if options.use_memory_constraint:
        # The bisection solves ~15 times: over many states, search a few cut points (an upper estimate).
        thorough = states.num_states <= options.tuning.quick_cut_points or options.worker_speeds is not None
        search = states if thorough else prefix_states(work, options.tuning.quick_cut_points)
        free = solve(search, hierarchy, replace(options, use_memory_constraint=False))
        if math.isfinite(free.time_s):
            need = minimum_memory(search, hierarchy, options, _peak_memory(free.parts, search, workers, options.memory))
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


def _peak_memory(parts: tuple[Part, ...], states: States, workers: int, memory_model: MemoryModel) -> float:
    peak, before = 0.0, 0
    for part in parts:
        low = part.start - 1
        factors = multipliers(memory_model, workers, before, part.replicas)
        if isinstance(memory_model, str):  # PipeDream's f (A + W), summed before the difference as always
            bytes_ = (states.activation[part.end - 1] + states.parameters[part.end - 1]) - (
                states.activation[low] + states.parameters[low] if low >= 0 else 0.0
            )
            peak = max(peak, factors[0] * bytes_)
        else:
            act = states.activation[part.end - 1] - (states.activation[low] if low >= 0 else 0.0)
            params = states.parameters[part.end - 1] - (states.parameters[low] if low >= 0 else 0.0)
            peak = max(peak, float(stage_bytes(factors, act, params)))
        before += part.replicas
    return peak


def data_parallel_time(states: States, hierarchy: Hierarchy) -> float:
    """PipeDream's data-parallel estimate: the whole model replicated at every level."""
    return float(data_parallel_seconds(float(states.compute[-1]), float(states.parameters[-1]), hierarchy.levels))


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
    memory_parts = []
    before = 0
    order = graph.topological_order
    # The footprint holds what autograd and the executor keep (memory.stash_bytes); legacy models PipeDream's A.
    stash = [c.activation_bytes for c in costs] if isinstance(options.memory, str) else stash_bytes(graph, stage_of, num_stages)
    for index, (part, cost) in enumerate(zip(solution.parts, costs)):
        r = part.replicas
        stages.append(
            StagePlan(
                stage_id=index,
                node_ids=tuple(n for n in order if stage_of[n] == index),
                num_replicas=r,
                compute_s=cost.compute_s,
                communication_s=stage_transfers(
                    cost, levels, level_replicas[index], boundary_levels[index - 1] if index > 0 else None,
                    boundary_levels[index] if index < num_stages - 1 else None, ratio,
                ),
                memory_bytes=stage_bytes(
                    multipliers(options.memory, workers, before, r), stash[index], cost.parameter_bytes
                ) + offload_bytes(options.memory),
                ranks=solution.part_ranks[index] if solution.part_ranks else (),
            )
        )
        memory_parts.append(footprint_parts(options.memory, stash[index], cost.parameter_bytes, workers, before, r))
        before += r
    # Footprint only: the search sums per-node stash; the values a stage sends and receives come on top of it
    # (the legacy models' search sums exactly what their plans report).
    footprint = options.use_memory_constraint and options.memory_model == "footprint"
    # (An offloaded optimizer state's chunk is in memory_bytes; the search's limit is the cap less it: straight_plan.)
    cap = hierarchy.memory_bytes + offload_bytes(options.memory) if options.memory_cap is None else options.memory_cap
    over = [s for s in stages if footprint and s.memory_bytes > cap]
    if over:
        worst = max(over, key=lambda s: s.memory_bytes)
        raise InfeasibleError(
            f"the best plan the search found needs {worst.memory_bytes:.4g} bytes on stage {worst.stage_id} once the "
            f"values it sends and receives are counted, over the {cap:.4g} bytes per worker allowed "
            f"(memory model {options.memory_model!r}); raise -s/--memory_size to at least that, or add workers")
    extra = {
        "cuts": solution.states.kind,
        "num_states": solution.states.num_states,
        "exact": solution.exact,
        "data_parallel_time_s": data_parallel_time(solution.states, hierarchy),
        "bandwidths": [level.bandwidth for level in hierarchy.levels],
        "memory_model": options.memory_model,
        "precision": precision_of(graph),  # what boundary bytes were priced at (graph/precision.py)
        "workers_unused": workers - before,
    }
    if options.footprint is not None:  # what each stage's predicted bytes are made of (`memory.py`)
        extra["footprint"] = options.footprint.to_dict()
        extra["memory"] = memory_parts
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
