"""`Tuning`: every budget and threshold of the optimizer's solves, in one place.

None of them changes which plan is optimal; they decide how much work `cuts="auto"` spends before it
settles for a plan it cannot prove optimal. The measurements behind the values are in
docs/optimizer.md ("Tuning") and bench/optimizer.py; here only what each one is for.
"""
from __future__ import annotations

from dataclasses import dataclass

from model_parallel.errors import PlanError

# About a few seconds of numpy on one core: the DP touches this many array elements at most.
WORK_BUDGET = 2.0e9


@dataclass(frozen=True)
class Tuning:
    """Budgets of `cuts="auto"` (core) and of the search layers (`optimizer/search`): states, array
    elements and passes, never seconds (a wall-clock budget made plans depend on the machine's load)."""

    # --- core -------------------------------------------------------------------------------------
    # Most array elements one DP may touch: decides how many cut points an inexact plan gets.
    work_budget: float = WORK_BUDGET
    # Topological cut points of the quick plan whose time bounds the exact solves (and the infeasibility
    # message's memory bisection, which solves ~15 times).
    quick_cut_points: int = 200

    # --- search: bounded exact solves (search/bounded.py) ---------------------------------------------
    # Most antichain states enumerated for a bounded solve (~1 us each (downsets.py) and ~1.5 us to sum their
    # costs: 0.75 s for 385,000; PipeDream's inception_v3 has 221,564, GPT-2 traced by torch.export 258,503).
    enumeration_limit: int = 300_000
    # Beyond it, the cuts of PipeDream's own walk from the main source alone (side branches join with
    # their first reader) still give the bounded solve candidate plans (not exact): at most this many.
    partial_walk_states: int = 5_000
    # PipeDream's antichain DP on a hierarchy is first bounded by a quick plan when it touches at least
    # this many elements: below, the quick plan over `quick_antichain_cut_points` prefixes costs about
    # what the bound saves.
    prune_min_work: float = 5e7
    quick_antichain_cut_points: int = 100
    # Work of the bounded solves below the best known time, tried in turn (`solve_below`): the work grows
    # steeply with the time bound, and the optimum is often just above the lower bound. One budget by
    # default (about 0.3 s at the cell DP's 10-27 ns an element); more, e.g. (WORK_BUDGET / 64,
    # WORK_BUDGET / 8, WORK_BUDGET), prove more plans in tens of seconds. Counted in elements, never in
    # seconds: the same input gives the same plan at any load.
    below_budgets: tuple[float, ...] = (WORK_BUDGET / 64,)
    # The cell DP (search/cells.py) runs a level when its work is at most 1/cell_gain of the dense
    # bounded DP's and at least cell_min_work (below that the dense DP is as fast as the bookkeeping).
    cell_gain: float = 4.0
    cell_min_work: float = 1e6
    # The ancestor matrix of a bounded solve's S states costs about this many DP elements per pair (S^2
    # pairs, ~3 ns each packed, a DP element ~1.5 ns): counted in its work, so a bound that keeps tens of
    # thousands of cuts is solved at a lower time instead (`solve_below`), where it keeps fewer.
    inclusion_cost: float = 2.0
    # Most outermost-boundary states the relaxed lower bound (search/relaxation.py) takes, and the
    # (state, state) pairs its passes may visit.
    max_relaxed_states: int = 40_000
    relaxation_budget: float = 4e7
    # On one level the same passes, at 30-50 ns a pair, would take most of the bar of 1 s (issue 26: BERT's
    # in-situ profiles spent 1-2 s there for a bound 0.5% tighter): a tenth of the pairs.
    one_level_relaxation_budget: float = 4e6

    # --- search: plans with unreplicated outermost stages (search/flat_search.py) ---------------------
    # Most states a flattened pass takes (each keeps a byte per inclusion it reads).
    max_flat_states: int = 12_000
    # (state, state) pairs the relaxation's passes may visit in all, and the heuristic's too (~10 ns a
    # pair compiled); at most `flat_most_passes` passes of each.
    flat_pass_budget: float = 6e7
    flat_most_passes: int = 24
    # The heuristic's first step up from the relaxation's time, the relaxation's first step down from the
    # best plan, and the relative gap at which both stop.
    flat_first_step: float = 0.01
    flat_bound_first_step: float = 0.02
    flat_tolerance: float = 0.001
    # The three-level proof: tried once the heuristic's plan is within `flat_proof_window` of the
    # relaxation's bound, for `flat_proof_first_passes` passes with exact inner rows at the first close
    # plan and the rest of `flat_proof_passes` at the heuristic's final one.
    flat_proof_window: float = 0.05
    flat_proof_first_passes: int = 2
    flat_proof_passes: int = 32
    # Inner rows: their (end, split) pairs in all; a row reaches `flat_row_reach` times the stage it is
    # computed for; a stage whose start has no row also gets rows for the starts within
    # `flat_row_neighbours` times the target time (where the next pass would move).
    flat_rows_budget: float = 5e7
    flat_row_reach: float = 2.0
    flat_row_neighbours: float = 0.5
    # The proof shows that no plan is this much (relative) faster.
    flat_proof_gap: float = 1e-8
    # Without numba the pass runs as plain Python (~1 us a pair): `auto` runs it only up to this many pairs.
    flat_python_pairs: float = 1e6

    def __post_init__(self) -> None:
        bad = [name for name, value in vars(self).items() if isinstance(value, (int, float)) and not value >= 0]
        if bad or not self.below_budgets:
            raise PlanError(f"Tuning values must be non-negative numbers and below_budgets non-empty; check {bad or ['below_budgets']}")
