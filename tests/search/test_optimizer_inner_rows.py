"""Exact inner rows (optimizer/inner_rows.py) and the proof they give the flattened search: a row is the
innermost level's optimum of every range from its start (checked against an exhaustive search written
from the rules); the relaxation with rows still admits the optimum; a search that says `exact` returns
the optimum."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from model_parallel.optimizer.search import flattened
from model_parallel.optimizer.search.bounded import cut_union
from model_parallel.optimizer.search.flat_kernel import included
from model_parallel.optimizer.search.flat_search import flat_search
from model_parallel.optimizer.search.flattened import flat_states, flat_witness
from model_parallel.optimizer.search.inner_rows import InnerRows
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.states import prefix_states
from model_parallel.optimizer.tuning import Tuning
from model_parallel.optimizer.antichains import enumerate_antichains
from support import first_fast
from support.optimizer import three_level_problem


def pod_rows(states, hierarchy, options) -> InnerRows:
    """Rows as the search makes them (`partition.inner_rows`), straight pipelines included."""
    levels = hierarchy.levels
    return InnerRows(states, levels[0], options, levels[0].num_machines * levels[1].num_machines * states.max_time_s)


def stage_time(states, level, options, start: int, end: int, workers: int, first: bool) -> float:
    """PipeDream's innermost stage (start, end] on `workers` (FORMATS.md), written out again."""
    if options.straight_pipeline and workers > 1:
        return math.inf
    before_c = states.compute[start] if start >= 0 else 0.0
    before_w = states.parameters[start] if start >= 0 else 0.0
    c, w = states.compute[end] - before_c, states.parameters[end] - before_w
    time_s = c / workers + 4 * w * (workers - 1) / (level.bandwidth * workers ** 2)
    if first or options.activation_compression_ratio is None:
        return time_s
    send = 2 * states.output[start] / (level.bandwidth * options.activation_compression_ratio)
    out = 0.0 if end == states.num_states - 1 else 2 * states.output[end] / (level.bandwidth * options.activation_compression_ratio)
    return max(time_s, send / workers, out / workers)


def brute_force_row(states, level, options, start: int, end: int) -> float:
    """Every chain of states strictly between, every split of at most G workers among its stages."""
    inside = [k for k in range(states.num_states)
              if included(states.inclusion, np.array(end), np.array(k)) and (start < 0 or included(states.inclusion, np.array(k), np.array(start)))]
    best = math.inf
    for size in range(min(len(inside), level.num_machines - 1) + 1):
        for chain in itertools.combinations(inside, size):
            bounds = [start, *chain, end]
            if any(not included(states.inclusion, np.array(b), np.array(a)) for a, b in zip(bounds[1:-1], bounds[2:])):
                continue
            for workers in itertools.product(range(1, level.num_machines + 1), repeat=size + 1):
                if sum(workers) <= level.num_machines:
                    best = min(best, max(stage_time(states, level, options, a, b, r, i == 0)
                                         for i, (a, b, r) in enumerate(zip(bounds, bounds[1:], workers))))
    return best


@pytest.mark.slow
@pytest.mark.parametrize("block", range(2))
def test_rows_are_the_innermost_optimum_of_each_range(block):
    checked = 0
    for seed in range(block * 20, block * 20 + 20):
        costs, hierarchy, options, optimum, work = three_level_problem(seed)
        if not math.isfinite(optimum):
            continue
        states = flat_states(costs, hierarchy, 2 * optimum)
        level = hierarchy.levels[0]
        rows = pod_rows(states, hierarchy, options)
        for start in [-1, *range(0, states.num_states - 1, 3)]:
            rows.add(start, math.inf)
            row = rows.rows[start]
            for at, end in enumerate(row.ends[:12]):
                expected = brute_force_row(states, level, options, start, int(end))
                assert row.times[at, -1] == pytest.approx(expected, rel=1e-12, abs=0.0), (seed, start, end)
                # The inner cuts rebuild a plan of that time.
                bounds = [start, *rows.inner_cuts(start, int(end)), int(end)]
                assert all(included(states.inclusion, np.array(b), np.array(a)) for a, b in zip(bounds[1:-1], bounds[2:]))
                checked += 1
    assert checked >= 200


@pytest.mark.parametrize("block", first_fast(2))
def test_relaxation_with_every_row_keeps_the_optimum_and_rejects_more(block):
    checked = tighter = 0
    for seed in range(block * 40, block * 40 + 40):
        costs, hierarchy, options, optimum, work = three_level_problem(seed)
        if not math.isfinite(optimum) or options.straight_pipeline:
            continue
        checked += 1
        states = flat_states(costs, hierarchy, 2 * optimum)
        none, every = pod_rows(states, hierarchy, options), pod_rows(states, hierarchy, options)
        for start in range(-1, states.num_states - 1):
            every.add(start, math.inf)
        assert flat_witness(states, hierarchy, options, optimum, every) is not None, seed
        for fraction in (0.9, 0.95, 0.99, 0.999):
            refined = flat_witness(states, hierarchy, options, fraction * optimum, every)
            plain = flat_witness(states, hierarchy, options, fraction * optimum, none)
            assert plain is not None or refined is None, (seed, fraction)
            tighter += refined is None and plain is not None
    assert checked >= 25
    assert tighter >= 3


@pytest.mark.slow
def test_passes_resumed_after_new_rows_match_fresh_ones(monkeypatch):
    # The proof's next pass at the same time keeps the entries of the states before the first start whose
    # row is new (they cannot change) and computes the rest: its tables must be those of a pass computed
    # from scratch, whichever rows were added in between. Small blocks, so that a pass resumes inside a
    # block and stages also start in earlier blocks.
    monkeypatch.setattr(flattened, "_BLOCK", 8)
    compared = resumed = 0
    for seed in range(30):
        costs, hierarchy, options, optimum, work = three_level_problem(seed)
        if not math.isfinite(optimum) or options.straight_pipeline:
            continue
        states = flat_states(costs, hierarchy, 2 * optimum)
        rng = np.random.default_rng(seed)
        for fraction in (0.97, 1.0):
            rows = pod_rows(states, hierarchy, options)
            kept = flat_witness(states, hierarchy, options, fraction * optimum, rows)
            for _ in range(4):
                if kept is None:
                    break
                for start, end in kept.stages[:: int(rng.integers(1, 3))]:
                    rows.add(start, math.inf)
                later = flat_witness(states, hierarchy, options, fraction * optimum, rows, kept)
                fresh = flat_witness(states, hierarchy, options, fraction * optimum, rows)
                assert (later is None) == (fresh is None), seed
                compared += 1
                if later is None:
                    break
                resumed += min(rows.added[kept.rows_seen:], default=-1) >= 0  # not from the very beginning
                for name in ("fewest_outer", "fewest_inner", "open_from", "closed_at", "source", "source_p"):
                    assert np.array_equal(getattr(later.table, name), getattr(fresh.table, name)), (seed, name)
                kept = later
    assert compared >= 60 and resumed >= 15


@pytest.mark.slow
@pytest.mark.parametrize("block", range(2))
def test_a_proven_search_returns_the_optimum(block):
    # The proof runs as soon as the heuristic finds a plan; whatever it says `exact` is the optimum over
    # PipeDream's antichains and the prefixes, and its plan is never worse than the one it started from.
    proof_always = Tuning(flat_proof_window=math.inf)
    checked = proven = 0
    for seed in range(block * 40, block * 40 + 40):
        costs, hierarchy, options, optimum, work = three_level_problem(seed)
        if not math.isfinite(optimum) or options.straight_pipeline:
            continue
        union = cut_union(work, enumerate_antichains(work))
        upper = replace(solve(prefix_states(work, 2), hierarchy, options), exact=False)
        if not math.isfinite(upper.time_s):
            continue
        found = flat_search(work, hierarchy, replace(options, tuning=proof_always), union, upper)
        assert found is not None
        best, lower = found
        checked += 1
        assert optimum * (1 - 1e-9) <= best.time_s <= upper.time_s * (1 + 1e-12)
        assert lower is None or lower <= optimum * (1 + 1e-9)
        if best.exact:
            proven += 1
            assert best.time_s == pytest.approx(optimum, rel=1e-9), seed
    assert checked >= 25
    assert proven >= 5

