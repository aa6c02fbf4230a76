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
  levels an unreplicated next-level machine is also held to its own G workers (*chains*, below);
  perfect balance alone would let a server split any node among its GPUs.
- **Proof** (`flat_witness`, three levels): the lower bound with exact inner times for the stages
  that start where `inner_rows.InnerRows` has a row, and the plan it finds (`Witness`), whose stages
  name the rows to compute next (`partition.flat_search`).
- **Heuristic** (`flat_plan_cuts`): `work` = the range data-parallel on every worker inside the machine
  (a real inner plan), outer stages never replicated. The cuts of the plan found go to the exact DP
  (`partition.solve`), which sets every replica count and time by the model: a real plan, usually
  much better than one over a few topological cut points on big hierarchies.

*Chains* (by lower bounds a little generous, never strict): a range (s, j] that perfect balance runs on
one next-level machine passes if one stage on at most all G workers fits (PipeDream's single-stage
time), or if a chain of stages might: a chain whose last stage (k, j] runs on r' workers (with its
transfers) holds at least `ceil(C(s, k) / T) + r'` workers, and one whose first stage (s, k] runs on r
workers holds at least `r + ceil(C(k, j) / T)` (every stage takes at least its compute over its
workers). Both must fit in G for some k strictly between. A range that fails counts 2 machines where
the replica rule allows, else 3 (never more than the truth).

The pass is one compiled loop over the pairs of states (`flat_kernel.py`); this module prepares the
states (`flat_states`: which pairs a pass reads) and reads its tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from model_parallel.errors import PlanError
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.search.bounds import ROUNDING
from model_parallel.optimizer.costs import data_parallel_seconds
from model_parallel.optimizer.search.flat_kernel import (
    Costs, FlatStates, Layout, Rules, Tables, flat_pass, included, level_transfers,
)
from model_parallel.optimizer.search.inner_rows import InnerRows
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.states import CutCosts, node_kinds

_BLOCK = 128


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
        np.concatenate((np.flatnonzero((compute[:block[0]] >= compute[block].min() - most_compute)
                                       | (parameters[:block[0]] >= parameters[block].min() - most_weights)), block))
        for block in blocks
    ]
    if sum(len(block) * len(read) for block, read in zip(blocks, columns)) > max_pairs:
        return None
    kinds = node_kinds(costs.matrix)
    members, outside = kinds.astype(np.float32), (~kinds).astype(np.float32)
    inside = []
    for block, read in zip(blocks, columns):
        within = (outside[block] @ members[read].T) == 0
        own = len(read) - len(block)
        within[:, own:] = np.tril(within[:, own:], -1)  # strictly inside: earlier in the block
        inside.append(within)
    inclusion = _inclusion_bits(len(compute), blocks, columns, inside) if len(hierarchy.levels) == 3 else None

    def offsets(sizes: list[int]) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)

    layout = Layout(
        block_starts=offsets([len(block) for block in blocks]), column_offsets=offsets([len(read) for read in columns]),
        columns=np.concatenate(columns).astype(np.int64), inside_offsets=offsets([within.size for within in inside]),
        inside=np.concatenate([within.ravel() for within in inside]).view(np.uint8),
    )
    return FlatStates(costs.members, compute, parameters, costs.output, max_time_s, layout, inclusion)


def _inclusion_bits(n: int, blocks: list[np.ndarray], columns: list[np.ndarray], inside: list[np.ndarray]) -> np.ndarray:
    """The blocks' inclusions as one bit matrix [later, earlier] (n^2 / 8 bytes)."""
    bits = np.zeros((n, (n + 7) // 8), dtype=np.uint8)
    for block, read, within in zip(blocks, columns, inside):
        rows = np.zeros((len(block), n), dtype=bool)
        rows[:, read] = within
        bits[block] = np.packbits(rows, axis=1)
    return bits


class _Pass(Tables):
    """One pass at a time limit: its tables (`flat_kernel.Tables`) and the plan they hold."""

    def feasible(self) -> bool:
        return bool(self.fewest_outer[-1] <= self.fewest_inner.shape[1])

    def cuts(self) -> Optional[list[int]]:
        """The states ending the inner stages of the plan found (last included), or None."""
        stages = self.witness()[0] if self.feasible() else []
        return sorted(end for _, end in stages) or None

    def witness(self) -> tuple[list[tuple[int, int]], bool]:
        """The next-level stages (start, end] of the plan found, from the last one back, as far as its
        outermost stages are unreplicated; and whether that reaches the beginning (a replicated outermost
        stage, perfect balance inside, has no such stages)."""
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


def _flat_pass(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float, heuristic: bool,
               rows: Optional[InnerRows] = None, previous: Optional[_Pass] = None, resume_from: int = 0) -> _Pass:
    """The tables `P` and `Q` (module doc) at `time_s` and where each entry came from: the relaxation's
    (with the exact inner `rows` given), or the heuristic's. With `previous` (a pass of the same problem at
    the same time), only the entries from state `resume_from` on are computed again."""
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
    n = states.num_states
    # The heuristic's work: the range data-parallel on every worker of the machine (a real inner plan; linear
    # in compute and weights); the relaxation's: perfect balance (no inner plan is faster).
    data_parallel = (data_parallel_seconds(1.0, 0.0, inside_levels), data_parallel_seconds(0.0, 1.0, inside_levels))
    chains = not heuristic and states.inclusion is not None
    innermost = levels[0]
    window, most_replicated_weights = _windows(hierarchy, limit)
    # Every field converted: the compiled pass is specialised (and cached) per argument type.
    rules = Rules(
        float(limit), int(outer_machines), int(inner_machines), float(workers_inside), float(within_inner),
        float(inner.bandwidth), float(outer.bandwidth), bool(straight),
        bool(not heuristic and outer_machines >= 2 and not straight), float(window), float(most_replicated_weights),
        bool(heuristic), float(data_parallel[0]), float(data_parallel[1]), bool(chains), int(innermost.num_machines),
        float(4 / innermost.bandwidth),
    )
    row_of, row_times = (np.full(n + 1, -1, dtype=np.int64), np.empty((0, 0))) if rows is None else rows.table()
    costs = Costs(
        states.compute, states.parameters, *level_transfers(states.output, inner, options),
        *level_transfers(states.output, outer, options), *level_transfers(states.output, innermost, options),
        states.inclusion if chains else np.zeros((1, 1), dtype=np.uint8), row_of, row_times,
    )
    if previous is None:
        resume_from = 0
        table = _Pass(
            fewest_outer=np.empty(n), fewest_inner=np.empty((n, outer_machines)), open_from=np.empty(n, dtype=np.int64),
            closed_at=np.empty(n, dtype=np.int64), source=np.empty((n, outer_machines), dtype=np.int64),
            source_p=np.empty((n, outer_machines), dtype=np.int64),
        )
    else:
        table = _Pass(*(array.copy() for array in previous))
    flat_pass(states.layout, costs, rules, resume_from, Tables(*table))  # plain Tables: one compiled signature
    return table


def flat_feasible(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float) -> bool:
    """Whether the relaxation (module doc) has a plan taking at most `time_s` (a little generous:
    ROUNDING); False proves that no plan over these cuts does."""
    return _flat_pass(states, hierarchy, options, time_s, heuristic=False).feasible()


@dataclass(frozen=True)
class Witness:
    """A plan of the relaxation: its next-level stages (start, end] in unreplicated outer stages, from the
    last one back; whether they reach the beginning (a replicated outer stage has none: perfect balance
    inside); and the starts after which an outer stage may open (its first next-level stage may be big).
    Also the pass it came from (its time, tables, and how many rows it had), for the next pass."""

    stages: list[tuple[int, int]]
    complete: bool
    may_open: frozenset[int]
    time_s: float
    table: _Pass
    rows_seen: int


def flat_witness(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float,
                 rows: InnerRows, previous: Optional[Witness] = None) -> Optional[Witness]:
    """The relaxation at `time_s` with the exact inner `rows`: None when it has no plan (no plan takes
    `time_s` or less), else the plan it found. After a `previous` witness at the same time, the pass
    resumes after the first start whose row is new since (entries before it do not change)."""
    resume = None
    if previous is not None and previous.time_s == time_s:
        resume = min((start + 1 for start in rows.added[previous.rows_seen:]), default=states.num_states)
    table = _flat_pass(states, hierarchy, options, time_s, heuristic=False, rows=rows,
                       previous=None if resume is None else previous.table, resume_from=resume or 0)
    if not table.feasible():
        return None
    stages, complete = table.witness()
    outer_machines = table.fewest_inner.shape[1]
    opening = frozenset(start for start, _ in stages if start < 0 or table.open_from[start] < outer_machines)
    return Witness(stages, complete, opening, time_s, table, len(rows.added))


def flat_plan_cuts(states: FlatStates, hierarchy: Hierarchy, options: PartitionOptions, time_s: float) -> Optional[list[int]]:
    """Members (downsets) of the cuts of a heuristic plan (module doc) within about `time_s`, for the exact
    DP to set its replicas and times; None when the heuristic finds none."""
    cuts = _flat_pass(states, hierarchy, options, time_s, heuristic=True).cuts()
    return None if cuts is None else [states.members[i] for i in cuts]
