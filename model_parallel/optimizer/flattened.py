"""The two outermost levels in one pass over the cut states, for plans whose outermost stages are
not replicated: a lower bound on the optimum and a fast heuristic plan where the exact DP is too big.

`dp.py` solves every range of an inner level (cubic in the states). But an outermost stage with one
replica takes just the slowest of the next level's stages inside it (and its own transfers): nothing
couples them (a replicated outer stage would add its all-reduce, over all of its weights, to each).
So those stages can be laid end to end and solved from the start of the graph in one pass, like one
level with two resources. For a time T, in state order (ancestors first):

- `P[j]`: the fewest outer machines that cover the states up to j with an outer boundary at j;
- `Q[j, p]`: the fewest next-level machines the current (unreplicated) outer stage uses up to j, with
  at most p outer machines before it.

A next-level stage (s, j] on r of its machines follows PipeDream's rules (FORMATS.md, as in
`brute_force_hierarchy`): time `(work + 4 (r-1) P / (B r) / M_inside) / r`, where only the first stage of
a chain divides the all-reduce by the machines inside and counts no transfers; later stages count
`2 O / (B r)` in and out (out unless the cut is the whole graph). The fewest r that meets T is used
(`relaxation.fewest_replicas`), and a level may use fewer machines than it has. Three uses:

- **Lower bound** (`flat_feasible`): `work` = compute over the machine's workers (perfect balance
  inside: no inner plan does better), and a replicated outer stage (s, j] is counted as in
  `relaxation.covers`: perfect balance over its workers, its exact all-reduce and transfers, from
  `P[s]`. Every plan is a plan of this relaxation taking no longer (replicas above the fewest only
  count as more machines), so if it has none within T, no plan takes T or less. Tighter than
  `relaxation.covers` because the next level's granularity, all-reduce and transfers count. On three
  levels an unreplicated next-level machine is also held to its own workers (`_InnerChains`): its
  range needs one stage on at most all of them, or a chain of stages on at most that many workers by
  the lower bounds below; perfect balance alone would let a server split any node among its GPUs.
- **Proof** (`flat_witness`, three levels): the lower bound with exact inner times for the stages
  that start where `inner_rows.InnerRows` has a row, and the plan it finds (`Witness`), whose stages
  name the rows to compute next (`partition.flat_search`). Its passes at one time share their machine
  counts (`PassMemo`), the rows raising them afterwards.
- **Heuristic** (`flat_plan_cuts`): `work` = the range data-parallel on every worker inside the machine
  (a real inner plan), outer stages never replicated. The cuts of the plan found go to the exact DP
  (`partition.solve`), which sets every replica count and time by the model: a real plan, usually
  much better than one over a few topological cut points on big hierarchies.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from model_parallel.errors import PlanError
from model_parallel.graph.plan import Hierarchy, Level
from model_parallel.optimizer.bounds import ROUNDING
from model_parallel.optimizer.costs import data_parallel_seconds
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.relaxation import fewest_replicas
from model_parallel.optimizer.states import CutCosts, node_kinds

if TYPE_CHECKING:
    from model_parallel.optimizer.inner_rows import InnerRows

# Most states the pass takes: each reads a band of earlier states (up to a next-level machine's compute
# back), ~50 ns per pair, and keeps their inclusions (a byte each).
MAX_FLAT_STATES = 12_000
_BLOCK = 128
_POSITIONS = float(1 << 20)  # more than the states of a pass


@dataclass(frozen=True)
class FlatStates:
    """Cut states ordered by size (ancestors first; the last holds every node) and, per block of
    `_BLOCK` states, which states a pass at up to `max_time_s` reads there and which of them lie inside."""

    members: tuple[int, ...]
    compute: np.ndarray
    parameters: np.ndarray
    output: np.ndarray
    max_time_s: float
    columns: tuple[np.ndarray, ...]  # per block: the earlier states a pass may read
    inside: tuple[np.ndarray, ...]  # per block: bool [state of the block, columns then the block's states]
    waves: tuple[list[np.ndarray], ...]  # per block: its states in groups, each after its ancestors in the block
    # On three levels: bit (later, earlier) set where state `earlier` lies strictly inside `later`, for the
    # pairs the blocks read (np.packbits rows), so the relaxation can chain a machine's own workers.
    inclusion: Optional[np.ndarray] = None

    @property
    def num_states(self) -> int:
        return len(self.compute)

    @property
    def pairs(self) -> int:
        """Pairs of states a pass may visit (its cost: ~50 ns each on this machine's cores)."""
        return sum(inside.size for inside in self.inside)


def _windows(hierarchy: Hierarchy, limit: float) -> tuple[float, float]:
    """The most compute of a next-level stage inside an unreplicated outer stage (its workers' at the
    limit), and the most weights of a replicated outer stage after the first (its all-reduce
    `4 P (r-1) / (B r^2)` fits the limit at r = M at best)."""
    outer, inner = hierarchy.levels[-1], hierarchy.levels[-2]
    workers_inside = math.prod(level.num_machines for level in hierarchy.levels[:-2])
    compute = inner.num_machines * workers_inside * limit * (1 + 1e-9)
    machines = outer.num_machines
    weights = limit * outer.bandwidth * machines ** 2 / (4 * (machines - 1)) * (1 + 1e-9) if machines > 1 else 0.0
    return compute, weights


def flat_states(costs: CutCosts, hierarchy: Hierarchy, max_time_s: float, max_pairs: float = math.inf) -> Optional[FlatStates]:
    """`costs` (from `cut_costs`: ordered by size, last = the whole graph) ready for passes at times up to
    `max_time_s`: only the inclusions those passes read are computed (a band of earlier states per block).
    None when a pass would visit more than `max_pairs` pairs of states."""
    compute, parameters = costs.compute, costs.parameters
    most_compute, most_weights = _windows(hierarchy, max_time_s * (1.0 + ROUNDING))
    blocks = [np.arange(begin, min(len(compute), begin + _BLOCK)) for begin in range(0, len(compute), _BLOCK)]
    columns = [
        np.flatnonzero((compute[:block[0]] >= compute[block].min() - most_compute)
                       | (parameters[:block[0]] >= parameters[block].min() - most_weights))
        for block in blocks
    ]
    if sum(len(block) * (len(read) + len(block)) for block, read in zip(blocks, columns)) > max_pairs:
        return None
    kinds = node_kinds(costs.matrix)
    members, outside = kinds.astype(np.float32), (~kinds).astype(np.float32)
    inside, waves = [], []
    for block, read in zip(blocks, columns):
        within = (outside[block] @ members[np.concatenate((read, block))].T) == 0
        within[:, len(read):] = np.tril(within[:, len(read):], -1)  # strictly inside: earlier in the block
        inside.append(within)
        waves.append(_waves(within[:, len(read):]))
    inclusion = _inclusion_bits(len(compute), columns, inside) if len(hierarchy.levels) == 3 else None
    return FlatStates(costs.members, compute, parameters, costs.output, max_time_s, tuple(columns), tuple(inside),
                      tuple(waves), inclusion)


def _inclusion_bits(n: int, columns: list[np.ndarray], inside: list[np.ndarray]) -> np.ndarray:
    """The blocks' inclusions as one bit matrix [later, earlier] (n^2 / 8 bytes)."""
    bits = np.zeros((n, (n + 7) // 8), dtype=np.uint8)
    for number, (read, within) in enumerate(zip(columns, inside)):
        begin = number * _BLOCK
        rows = np.zeros((len(within), n), dtype=bool)
        rows[:, np.concatenate((read, np.arange(begin, begin + len(within))))] = within
        bits[begin:begin + len(within)] = np.packbits(rows, axis=1)
    return bits


@dataclass
class _Pass:
    """One pass at a time limit: the tables above and, for the heuristic, where each entry came from."""

    fewest_outer: np.ndarray  # P [state]
    fewest_inner: np.ndarray  # Q [state, p]
    open_from: np.ndarray  # [state]: the fewest p (outer machines before) an unreplicated outer stage starting after it has; M: none
    closed_at: np.ndarray  # [state]: p of the unreplicated outer stage that ends at the state (-1: none)
    source: np.ndarray  # [state, p]: the state the entry's last inner stage starts after (-1: the beginning)
    source_p: np.ndarray  # [state, p]: the entry it extends there (its p, or the p of the outer stage closed there)

    def feasible(self) -> bool:
        return bool(self.fewest_outer[-1] <= self.fewest_inner.shape[1])

    def cuts(self) -> Optional[list[int]]:
        """The states ending the inner stages of the plan found (last included), or None."""
        stages = self.witness()[0] if self.feasible() else []
        return sorted(end for _, end in stages) or None

    def witness(self) -> tuple[list[tuple[int, int]], bool]:
        """The next-level stages (start, end] of the plan found (a tracked pass), from the last one back,
        as far as its outermost stages are unreplicated; and whether that reaches the beginning (a
        replicated outermost stage, perfect balance inside, has no such stages)."""
        j = len(self.closed_at) - 1
        p = int(self.closed_at[j])
        stages: list[tuple[int, int]] = []
        while p >= 0:
            s = int(self.source[j, p])
            stages.append((s, j))
            if s < 0:
                return stages, True
            j, p = s, int(self.source_p[j, p])  # an outer stage opened after s: the p it closed there (-1: replicated)
        return stages, False


def level_transfers(output: np.ndarray, level: Level, options: PartitionOptions) -> tuple[np.ndarray, np.ndarray]:
    """Per state, a stage's transfer over the level's links of the activations crossing it (`2 O / (B R)`,
    zero when transfers are not counted) as its input, and as its output (none from the whole graph)."""
    ratio = options.activation_compression_ratio
    send = np.zeros(len(output)) if ratio is None else 2 * output / (level.bandwidth * ratio)
    return send, np.where(np.arange(len(output)) < len(output) - 1, send, 0.0)


def included(bits: np.ndarray, later: np.ndarray, earlier: np.ndarray) -> np.ndarray:
    """Whether `earlier` lies strictly inside `later` (elementwise, broadcast) in packed inclusion bits."""
    return ((bits[later, earlier >> 3] >> (7 - (earlier & 7))) & 1).astype(bool)


class _InnerChains:
    """Whether one machine's workers (the innermost level, three levels in all) can run a range (s, j] as a
    next-level stage of one replica within the limit, by lower bounds a little generous, never strict.

    Perfect balance (`C / G <= T`) says yes to ranges no inner plan runs within T: nodes do not split.
    A range passes if one stage on at most all G workers fits (PipeDream's single-stage time), or if a
    chain of stages might: a chain whose last stage (k, j] runs on r' workers (with its transfers) holds
    at least `ceil(C(s, k) / T) + r'` workers, and one whose first stage (s, k] runs on r workers holds at
    least `r + ceil(C(k, j) / T)` (every stage takes at least its compute over its workers). Both must
    fit in G for some k strictly between; only the ranges one stage cannot run are checked."""

    def __init__(self, states: FlatStates, level: Level, options: PartitionOptions, limit: float) -> None:
        self.states, self.limit = states, limit
        self.most, self.straight = level.num_machines, options.straight_pipeline
        self.reduce = 4 / level.bandwidth
        self.send, self.out = level_transfers(states.output, level, options)

    def fits(self, ends: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Per pair (start, end] (start -1: the beginning of the graph): whether a machine may run it."""
        compute, parameters = self.states.compute, self.states.parameters
        c_start = np.where(starts >= 0, compute[starts], 0.0)
        w_start = np.where(starts >= 0, parameters[starts], 0.0)
        single = fewest_replicas(compute[ends] - c_start, self.reduce * (parameters[ends] - w_start), np.zeros(len(ends)),
                                 self.limit, self.most, self.straight)
        fits = single <= self.most
        for at in np.array_split(np.flatnonzero(~fits), max(1, int(np.count_nonzero(~fits)) // 512)):
            if at.size:
                fits[at] = self._chain_fits(ends[at], starts[at], c_start[at], w_start[at])
        return fits

    def _chain_fits(self, ends: np.ndarray, starts: np.ndarray, c_start: np.ndarray, w_start: np.ndarray) -> np.ndarray:
        compute, parameters, limit = self.states.compute, self.states.parameters, self.limit
        # Candidate splits k: strictly inside the end and containing the start (every state contains the
        # beginning), the last stage within the machine's workers.
        near = np.flatnonzero((compute >= c_start.min()) & (compute <= compute[ends].max()))
        start = np.maximum(starts, 0)[:, None]
        inside_end = included(self.states.inclusion, ends[:, None], near[None, :])
        holds_start = (starts < 0)[:, None] | included(self.states.inclusion, near[None, :], start)
        allowed = inside_end & holds_start & (compute[ends][:, None] - compute[near][None, :] <= self.most * limit * (1 + 1e-9))
        pair, at = np.nonzero(allowed)
        split, end = near[at], ends[pair]
        before, after = compute[split] - c_start[pair], compute[end] - compute[split]
        last = fewest_replicas(after, self.reduce * (parameters[end] - parameters[split]),
                               np.maximum(self.send[split], self.out[end]), limit, self.most, self.straight)
        first = fewest_replicas(before, self.reduce * (parameters[split] - w_start[pair]), np.zeros(len(split)), limit,
                                self.most, self.straight)
        # Each bound holds for every chain through its own split (the last one's, the first one's).
        by_last, by_first = np.full(len(ends), math.inf), np.full(len(ends), math.inf)
        np.minimum.at(by_last, pair, np.maximum(np.ceil(before / limit * (1 - ROUNDING)), 1.0) + last)
        np.minimum.at(by_first, pair, first + np.maximum(np.ceil(after / limit * (1 - ROUNDING)), 1.0))
        return np.maximum(by_last, by_first) <= self.most

    def raise_unfit(self, count: np.ndarray, ends: np.ndarray, starts: np.ndarray, work: np.ndarray, reduce: np.ndarray,
                    moved: np.ndarray, machines: int) -> np.ndarray:
        """`count` [end, start] of next-level machines (at most `machines`), at least 2 where one machine's
        workers cannot run the stage: 2 when `fewest_replicas`' rule allows it, else 3 (never more than
        the truth)."""
        row, column = np.nonzero(count == 1)
        if not row.size:
            return count
        unfit = ~self.fits(ends[row], starts[column])
        if not unfit.any():
            return count
        row, column = row[unfit], column[unfit]
        w, r, m = (np.broadcast_to(a, count.shape)[row, column] for a in (work, reduce, moved))
        two = (w / 2 + r / 4 <= self.limit) & (m / 2 <= self.limit)
        count = count.copy()
        raised = np.full(len(row), math.inf) if self.straight else np.where(two, 2.0, 3.0)
        count[row, column] = np.where(raised <= machines, raised, math.inf)
        return count


class _Columns:
    """Machine counts [end, start] of fixed ends against candidate starts, each column computed when first
    asked for (float32 holds them exactly: whole numbers and inf)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.values = np.empty(shape, dtype=np.float32)
        self.known = np.zeros(shape[1], dtype=bool)

    def get(self, at: np.ndarray, count: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """The columns `at`; `count(missing)` computes those not known yet."""
        missing = at[~self.known[at]]
        if missing.size:
            self.values[:, missing] = count(missing)
            self.known[missing] = True
        return self.values[:, at].astype(np.float64)


@dataclass
class PassMemo:
    """The relaxation's machine counts at one limit, kept for the next pass of the same problem at that limit
    (the proof runs several): they depend on neither the tables nor the exact inner rows, applied afterwards.
    The first pass pays ~10% more to keep them, the next ones take about half the time."""

    limit: float = math.nan
    counts: dict = field(default_factory=dict)  # (kind, block number[, opening]) -> counts or _Columns


def _flat_pass(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float, heuristic: bool,
               rows: Optional[InnerRows] = None, track: bool = False, memo: Optional[PassMemo] = None) -> _Pass:
    """The tables `P` and `Q` (module doc) at `time_s`: the relaxation's (with the exact inner `rows` given,
    where each entry came from when `track`, and its counts kept in `memo`), or the heuristic's with where
    each entry came from."""
    levels = hierarchy.levels
    outer, inner = levels[-1], levels[-2]
    outer_machines, inner_machines = outer.num_machines, inner.num_machines
    inside_levels = levels[:-2]
    workers_inside = math.prod(level.num_machines for level in inside_levels)  # per next-level machine
    within_inner = inside_levels[-1].num_machines if inside_levels else 1
    straight = options.straight_pipeline
    limit = time_s * (1.0 + ROUNDING)
    if time_s > states.max_time_s:
        raise PlanError(f"a flattened pass at {time_s} s over states prepared for at most {states.max_time_s} s")
    compute, parameters, output = states.compute, states.parameters, states.output
    n = states.num_states
    zero = np.zeros(1)
    outer_send, outer_out = level_transfers(output, outer, options)
    inner_send, inner_out = level_transfers(output, inner, options)
    if heuristic:  # the range data-parallel on every worker of the machine: a real inner plan
        def work_of(c: np.ndarray, w: np.ndarray) -> np.ndarray:
            return data_parallel_seconds(c, w, inside_levels)
    else:  # perfect balance: no inner plan is faster
        def work_of(c: np.ndarray, w: np.ndarray) -> np.ndarray:
            return c / workers_inside
    replicated_outer = not heuristic and outer_machines >= 2 and not straight
    window, most_replicated_weights = _windows(hierarchy, limit)
    chains = None if heuristic or states.inclusion is None else _InnerChains(states, levels[0], options, limit)
    memo = None if heuristic else memo
    if memo is not None and memo.limit != limit:
        memo.limit, memo.counts = limit, {}

    def remembered(key: tuple, make: Callable[[], object]) -> object:
        """`make()`, once per limit when `memo` keeps the counts."""
        if memo is None:
            return make()
        if key not in memo.counts:
            memo.counts[key] = make()
        return memo.counts[key]

    def columns(key: tuple, shape: tuple[int, int], count: Callable[[np.ndarray], np.ndarray], at: np.ndarray) -> np.ndarray:
        """`count(at)`, the columns `at` of counts [end, start] of `shape`: each once per limit with `memo`."""
        if memo is None:
            return count(at)
        if key not in memo.counts:
            memo.counts[key] = _Columns(shape)
        return memo.counts[key].get(at, count)

    table = _Pass(
        fewest_outer=np.full(n, math.inf), fewest_inner=np.full((n, outer_machines), math.inf),
        open_from=np.full(n, outer_machines), closed_at=np.full(n, -1),
        source=np.full((n, outer_machines), -1), source_p=np.zeros((n, outer_machines), dtype=int),
    )

    def inner_counts(ends: np.ndarray, starts: np.ndarray, opening: bool) -> np.ndarray:
        """[end, start]: machines of a next-level stage (start, end] (start -1: the beginning) that opens
        its outer stage (the first of its chain: all-reduce over the machines inside, no transfers) or
        continues it, before the exact inner rows."""
        before = starts >= 0
        c = compute[ends][:, None] - np.where(before, compute[starts], 0.0)[None, :]
        w = parameters[ends][:, None] - np.where(before, parameters[starts], 0.0)[None, :]
        work, reduce, moved = work_of(c, w), *stage_costs(w, ends, starts, opening)
        count = fewest_replicas(work, reduce, moved, limit, inner_machines, straight)
        return count if chains is None else chains.raise_unfit(count, ends, starts, work, reduce, moved, inner_machines)

    def stage_costs(w: np.ndarray, ends: np.ndarray, starts: np.ndarray, opening: bool) -> tuple[np.ndarray, np.ndarray]:
        """A next-level stage's all-reduce coefficient and transfers (module doc)."""
        if opening:
            return 4 * w / (inner.bandwidth * within_inner), np.zeros((1, 1))
        return 4 * w / inner.bandwidth, np.maximum(inner_send[starts][None, :], inner_out[ends][:, None])

    def with_rows(count: np.ndarray, ends: np.ndarray, starts: np.ndarray, opening: bool) -> np.ndarray:
        """`count` [end, start] raised to what the exact inner times need, for the starts with a row."""
        at = np.empty(0, dtype=int) if rows is None else rows.with_row(starts)
        if not at.size:
            return count
        some = starts[at]
        w = parameters[ends][:, None] - np.where(some >= 0, parameters[some], 0.0)[None, :]
        reduce, moved = stage_costs(w, ends, some, opening)
        count = np.array(count, dtype=float)
        count[:, at] = rows.exact_counts(count[:, at], ends, some, reduce, moved, limit, inner_machines)
        return count

    def outer_counts(ends: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """[end, start]: replicas (at least 2) of a replicated outer stage (start, end] (not the first)."""
        c = compute[ends][:, None] - compute[starts][None, :]
        w = parameters[ends][:, None] - parameters[starts][None, :]
        moved = np.maximum(outer_send[starts][None, :], outer_out[ends][:, None])
        count = fewest_replicas(c / (workers_inside * inner_machines), 4 * w / outer.bandwidth, moved, limit,
                                outer_machines, straight)
        return np.maximum(count, 2.0)

    for number, begin in enumerate(range(0, n, _BLOCK)):
        block = np.arange(begin, min(n, begin + _BLOCK))
        read, inside = states.columns[number], states.inside[number]
        # Stages from the beginning of the graph: the first of both chains (no transfers).
        c, w = compute[block], parameters[block]
        beginning = np.array([-1])
        first = remembered(("first", number), lambda: inner_counts(block, beginning, True))
        first = with_rows(first, block, beginning, True)
        best = _Best(np.repeat(first, outer_machines, axis=1), heuristic or track)
        if replicated_outer:
            count = fewest_replicas(c / (workers_inside * inner_machines), 4 * w / (outer.bandwidth * inner_machines),
                                    zero, limit, outer_machines, straight)
            outer_best = np.maximum(count, 2.0)
        else:
            outer_best = np.full(len(block), math.inf)
        # From the states of earlier blocks, settled.
        near = np.flatnonzero(compute[read] >= c.min() - window)
        if near.size:
            starts = read[near]

            def earlier_counts(at: np.ndarray, opening: bool, block: np.ndarray = block, starts: np.ndarray = starts,
                               number: int = number) -> np.ndarray:
                count = columns(("from earlier", number, opening), (len(block), len(starts)),
                                lambda some: inner_counts(block, starts[some], opening), at)
                return with_rows(count, block, starts[at], opening)

            best.offer(earlier_counts, block, starts, inside[:, near], table)
        if replicated_outer:
            light = np.flatnonzero(np.isfinite(table.fewest_outer[read]) & (parameters[read] >= w.min() - most_replicated_weights))
            if light.size:
                replicas = columns(("outer from earlier", number), (len(block), len(read)),
                                   lambda some: outer_counts(block, read[some]), light)
                totals = table.fewest_outer[None, read[light]] + replicas
                outer_best = np.minimum(outer_best, np.where(inside[:, light], totals, math.inf).min(axis=1))
        # From states of this block: in waves, each after all of its ancestors in the block.
        outer_in = remembered(("outer within", number), lambda: outer_counts(block, block)) if replicated_outer else None
        counted = remembered(("within", number), lambda: {opening: inner_counts(block, block, opening) for opening in (True, False)})
        counted = {opening: with_rows(count, block, block, opening) for opening, count in counted.items()}
        among = inside[:, len(read):]
        for wave in states.waves[number]:
            allowed = among[wave]

            def wave_counts(at: np.ndarray, opening: bool, wave: np.ndarray = wave) -> np.ndarray:
                return counted[opening][wave][:, at]

            best.offer(wave_counts, block[wave], block, allowed, table, wave)
            if outer_in is not None:
                totals = np.where(allowed, table.fewest_outer[block][None, :] + outer_in[wave], math.inf)
                outer_best[wave] = np.minimum(outer_best[wave], totals.min(axis=1))
            _settle(table, block[wave], best, wave, outer_best[wave], inner_machines, limit, outer_send)
    return table


def _waves(among: np.ndarray) -> list[np.ndarray]:
    """Rows of a strictly lower-triangular inclusion matrix grouped by the longest chain of ancestors
    above them: each group only reads groups before it."""
    depth = np.zeros(len(among), dtype=int)
    for row in range(1, len(among)):
        above = depth[:row][among[row, :row]]
        depth[row] = above.max() + 1 if above.size else 0
    return [np.flatnonzero(depth == d) for d in range(int(depth.max()) + 1)] if len(among) else []


class _Best:
    """The best entries `Q[j, p]` of a block of states so far and, for the heuristic, where they came from."""

    def __init__(self, value: np.ndarray, track: bool) -> None:
        self.value = value  # [row, p]
        self.track = track
        self.source = np.full(value.shape, -1)
        self.source_p = np.zeros(value.shape, dtype=int)

    def offer(
        self, counts: Callable[[np.ndarray, bool], np.ndarray], ends: np.ndarray, starts: np.ndarray,
        allowed: np.ndarray, table: _Pass, rows: "slice | np.ndarray" = slice(None),
    ) -> None:
        """Offer the stages (start, end] where `allowed` [end, start]: `counts(at, opening)` gives the
        machines of those from `starts[at]` when they open an outer stage after the start or continue one
        there."""
        current = self.value[rows]
        outer_machines = current.shape[1]
        usable = allowed.any(axis=0)
        # Opening after s needs p >= open_from[s]: the best per threshold, then a running minimum over p.
        at = np.flatnonzero(usable & (table.open_from[starts] < outer_machines))
        if at.size:
            at = at[np.argsort(table.open_from[starts[at]], kind="stable")]
            thresholds = table.open_from[starts[at]]
            first = np.flatnonzero(np.r_[True, thresholds[1:] != thresholds[:-1]])
            count = np.where(allowed[:, at], counts(at, True), math.inf)
            if self.track:  # machine counts are whole numbers: one min over count * 2^20 + position finds both
                count = count * _POSITIONS + np.arange(at.size, dtype=float)
            candidates = np.full(current.shape, math.inf)
            candidates[:, thresholds[first]] = np.minimum.reduceat(count, first, axis=1)
            self._take(np.minimum.accumulate(candidates, axis=1), current, starts[at], table, rows, opens=True)
        # Continuing after s from its entry at the same p.
        at = np.flatnonzero(usable & np.isfinite(table.fewest_inner[starts, -1]))  # entries fall with p
        if at.size:
            count = np.where(allowed[:, at], counts(at, False), math.inf)
            entries = np.ascontiguousarray(table.fewest_inner[starts[at]].T)  # C order: the min below runs along rows
            if self.track:
                count, entries = count * _POSITIONS, entries * _POSITIONS + np.arange(at.size, dtype=float)
            candidates = count[:, None, :] + entries[None]  # [rows, p, start]
            self._take(candidates.min(axis=2), current, starts[at], table, rows, opens=False)
        self.value[rows] = current

    def _take(
        self, found: np.ndarray, current: np.ndarray, starts: np.ndarray, table: _Pass, rows: "slice | np.ndarray",
        opens: bool,
    ) -> None:
        """Lower `current` [rows, p] in place to `found` (keys count * 2^20 + position when tracking)."""
        if not self.track:
            np.minimum(current, found, out=current)
            return
        value = np.floor(found / _POSITIONS)
        better = value < current
        position = np.zeros(value.shape, dtype=int)
        position[better] = (found[better] - value[better] * _POSITIONS).astype(int)
        source = starts[position]
        source_p = table.closed_at[source] if opens else np.broadcast_to(np.arange(value.shape[1]), value.shape)
        current[better] = value[better]
        self.source[rows] = np.where(better, source, self.source[rows])
        self.source_p[rows] = np.where(better, source_p, self.source_p[rows])


def _settle(
    table: _Pass, states: np.ndarray, best: _Best, rows: np.ndarray, replicated: np.ndarray, inner_machines: int,
    limit: float, outer_send: np.ndarray,
) -> None:
    """Final entries of `states` (rows of `best`): at most p outer machines before (a running minimum
    over p), the unreplicated outer stage closing there (fewest machines before it; one after others
    sends its output on, except from the whole graph), the replicated alternative, and whether an
    unreplicated outer stage may open after them (its input arrives within the limit)."""
    value = best.value[rows]
    # The p' <= p each entry comes from (the first of the least): a running minimum of count * M + p'.
    machines = value.shape[1]
    keys = np.minimum.accumulate(value * machines + np.arange(machines), axis=1)
    fewest = np.floor(keys / machines)
    kept = np.zeros(value.shape, dtype=int)
    finite = np.isfinite(keys)
    kept[finite] = (keys[finite] - fewest[finite] * machines).astype(int)
    table.fewest_inner[states] = fewest
    table.source[states] = np.take_along_axis(best.source[rows], kept, axis=1)
    table.source_p[states] = np.take_along_axis(best.source_p[rows], kept, axis=1)
    last = len(table.fewest_outer) - 1
    leaves = (states == last) | (outer_send[states] <= limit)
    fits = (fewest <= inner_machines) & ((np.arange(value.shape[1]) == 0)[None, :] | leaves[:, None])
    first_fit = fits.argmax(axis=1)
    closing = np.where(fits.any(axis=1), first_fit + 1.0, math.inf)
    unreplicated = closing <= replicated
    table.fewest_outer[states] = np.where(unreplicated, closing, replicated)
    table.closed_at[states] = np.where(unreplicated & np.isfinite(closing), first_fit, -1)
    may_open = (states < last) & (outer_send[states] <= limit) & (table.fewest_outer[states] < value.shape[1])
    table.open_from[states] = np.where(may_open, np.minimum(table.fewest_outer[states], value.shape[1]), value.shape[1]).astype(int)


def flat_feasible(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float) -> bool:
    """Whether the relaxation (module doc) has a plan taking at most `time_s` (a little generous:
    ROUNDING); False proves that no plan over these cuts does."""
    return _flat_pass(states, hierarchy, options, time_s, heuristic=False).feasible()


@dataclass(frozen=True)
class Witness:
    """A plan of the relaxation: its next-level stages (start, end] in unreplicated outer stages, from the
    last one back; whether they reach the beginning (a replicated outer stage has none: perfect balance
    inside); and the starts after which an outer stage may open (its first next-level stage may be big)."""

    stages: list[tuple[int, int]]
    complete: bool
    may_open: frozenset[int]


def flat_witness(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float,
                 rows: InnerRows, memo: Optional[PassMemo] = None) -> Optional[Witness]:
    """The relaxation at `time_s` with the exact inner `rows`: None when it has no plan (no plan takes
    `time_s` or less), else the plan it found. `memo` keeps its counts for the next pass at `time_s`."""
    table = _flat_pass(states, hierarchy, options, time_s, heuristic=False, rows=rows, track=True, memo=memo)
    if not table.feasible():
        return None
    stages, complete = table.witness()
    outer_machines = table.fewest_inner.shape[1]
    opening = frozenset(start for start, _ in stages if start < 0 or table.open_from[start] < outer_machines)
    return Witness(stages, complete, opening)


def flat_plan_cuts(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float) -> Optional[list[int]]:
    """Members (downsets) of the cuts of a heuristic plan (module doc) within about `time_s`, for the exact
    DP to set its replicas and times; None when the heuristic finds none."""
    cuts = _flat_pass(states, hierarchy, options, time_s, heuristic=True).cuts()
    return None if cuts is None else [states.members[i] for i in cuts]
