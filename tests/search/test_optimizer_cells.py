"""Solving only the DP cells a plan within a time bound can use (`cells.py`) keeps the optimum exact."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.search.bounded import solve_bounded
from model_parallel.optimizer.search.bounds import level_bounds, row_states
from model_parallel.optimizer.search.cells import cell_mask, level_cell_work, stage_contexts
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.tuning import Tuning
from model_parallel.optimizer.antichains import antichain_states, enumerate_antichains
from model_parallel.optimizer.states import preprocess, prefix_states
from support import first_fast
from support.optimizer import problem, union_states

HIERARCHIES = [
    ([2, 2], [40e9, 1e9]), ([3, 2], [40e9, 2e9]), ([4, 4], [40e9, 1e9]), ([2, 2, 2], [40e9, 10e9, 1e9]),
    ([4, 2, 2], [40e9, 5e9, 1e9]),
]


# Every bounded level runs over cells, however small.
ALWAYS_CELLS = Tuning(cell_min_work=0.0, cell_gain=0.0)


def test_stage_contexts_list_every_start_a_row_can_have():
    two = stage_contexts(Hierarchy.from_lists([2, 2], [1e9, 1e9]))
    assert [tuple(map(tuple, c)) for c in two] == [((0, 1), (0, 2), (2, 1)), ((0, 1),)]
    straight = stage_contexts(Hierarchy.from_lists([2, 2], [1e9, 1e9]), straight_pipeline=True)
    assert tuple(map(tuple, straight[0])) == ((0, 1), (2, 1))
    three = stage_contexts(Hierarchy.from_lists([2, 2, 2], [1e9, 1e9, 1e9]))
    assert tuple(map(tuple, three[1])) == ((0, 1), (0, 2), (4, 1))
    assert tuple(map(tuple, three[0])) == ((0, 1), (0, 2), (0, 4), (2, 1), (4, 1), (4, 2), (6, 1))


def test_a_cell_outside_every_window_is_dropped():
    # States 0..7 with compute 1..8 (one unit each) on [2, 2] at T = 2: the 4 workers are all needed.
    # A server's row after state 3 (4 units done by the first server) reaches state 5 on one worker and
    # the last state on both.
    compute = np.arange(1.0, 9.0)
    hierarchy = Hierarchy.from_lists([2, 2], [1e9, 1e9])
    mask = cell_mask(compute, np.array([-1, 3]), 0, hierarchy, 2.0)
    assert np.flatnonzero(mask[1, :, 0]).tolist() == [5]
    assert np.flatnonzero(mask[1, :, 1]).tolist() == [7]
    # From the start: one worker reaches state 1 (2 units), or state 3 when the first server's stage is
    # replicated on both servers (context (0, 2)); two workers reach state 3, or the last state so.
    assert np.flatnonzero(mask[0, :, 0]).tolist() == [1, 3]
    assert np.flatnonzero(mask[0, :, 1]).tolist() == [3, 7]


@pytest.mark.parametrize("block", first_fast(4))
def test_the_dp_over_cells_equals_the_dense_bounded_dp(block):
    """Random DAGs, every option, two- and three-level hierarchies, PipeDream's states (not-a-range
    entries) and the union: at a loose bound and at the optimum the same time and plan as the dense
    bounded DP (and the full DP); below the optimum, no plan within the bound."""
    checked = below = 0
    for seed in range(block * 8, block * 8 + 8):
        graph, memory_hierarchy, options = problem(seed)
        options = replace(options, tuning=ALWAYS_CELLS)
        machines, bandwidths = HIERARCHIES[seed % len(HIERARCHIES)]
        hierarchy = Hierarchy.from_lists(machines, bandwidths, memory_bytes=memory_hierarchy.memory_bytes)
        work = preprocess(graph)
        for states in (antichain_states(work), union_states(work, enumerate_antichains(work))):
            full = solve(states, hierarchy, options)
            if not math.isfinite(full.time_s):
                continue
            loose = solve(prefix_states(work, 4 + seed % 5), hierarchy, options).time_s
            for upper in {loose if math.isfinite(loose) else 2 * full.time_s, full.time_s, full.time_s * 0.999}:
                bounds = level_bounds(states.compute, states.output, hierarchy, upper, options.activation_compression_ratio)
                over_cells = solve_bounded(states, hierarchy, options, bounds)
                if upper < full.time_s:
                    below += 1
                    assert over_cells.time_s > upper or not math.isfinite(over_cells.time_s), (seed, upper)
                    continue
                checked += 1
                dense = solve_bounded(states, hierarchy, options, bounds, use_cells=False)
                assert over_cells.time_s == dense.time_s, (seed, states.kind, upper)
                assert over_cells.time_s == pytest.approx(full.time_s, rel=1e-12, abs=0)
                assert (over_cells.parts, over_cells.level_replicas) == (dense.parts, dense.level_replicas)
    assert checked >= 12 and below >= 4


def test_the_cell_work_estimate_never_undercounts():
    """auto picks the bound of a solve below the best time from this estimate: it must cover the
    candidates the cells give (every wanted column against every wanted split, per row)."""
    for seed in range(10):
        graph, _, options = problem(seed)
        hierarchy = Hierarchy.from_lists(*HIERARCHIES[seed % len(HIERARCHIES)])
        states = union_states(preprocess(graph), enumerate_antichains(preprocess(graph)))
        optimum = solve(states, hierarchy, options).time_s
        for factor in (1.0, 1.1):
            bounds = level_bounds(states.compute, states.output, hierarchy, optimum * factor, None)
            for number, level in enumerate(hierarchy.levels):
                rows = row_states(bounds, number)
                mask = cell_mask(states.compute, rows, number, hierarchy, optimum * factor, options.straight_pipeline)
                wanted = mask.sum(axis=1).astype(float)  # [row, m-1]
                real = sum(
                    float(np.sum(wanted[:, m - 1] * wanted[:, m - last - 1]))
                    for m in range(2, level.num_machines + 1) for last in range(1, 2 if options.straight_pipeline else m)
                )
                estimate = level_cell_work(states.compute, rows, number, hierarchy, optimum * factor, options.straight_pipeline)
                assert real <= estimate * (1 + 1e-9), (seed, number)
