"""Zero-bubble orders list-built from stage times: the fixed (torch) orders are optimal only when every stage takes as long.

zbh1, zbinterleaved and zbv run torch's fixed per-rank orders (zero_bubble.py). Once stage times differ (a slow
rank, a plan re-solved around it) another order of the same actions can finish sooner. `timed_schedule` builds
one by greedy list scheduling over the base schedule's placement and memory bound, and keeps it only when the
simulator (optimizer/simulate.py) predicts it more than `MARGIN` faster:

    repeat until every action is placed:
        each rank: its ready actions (dependencies done, F only under the in-flight bounds), each starting at
                   max(rank free, inputs ready); the earliest start, ties broken by a priority (I before F
                   before W, or F first; deeper stage first)
        place the earliest of the ranks' picks (ties: the lowest rank)

Each variant is built from the times as given and from them rounded to 5 % of their median (`quantized`): measured
times are never exactly equal, and a greedy that sees two nearly equal stages as equal often finds the better
order (the live straggler's plan: 1510 -> 1458 ms, where the exact times find no gain); every order is judged on
the exact times. Each stage still runs its F's, I's and W's in increasing microbatch order (the runtime's message matching;
`schedule.check`), W(s, j) after I(s, j). Bounds, per rank: the base's `max_in_flight` (pairs forwarded and
not through I, counted as `check` counts them) and the base order's own peak of pairs forwarded and not through
W (our I keeps a microbatch's autograd graph until its W: the memory the schedule is priced for,
graph/in_flight.py `activations_held`). Gradients accumulate per stage in microbatch order whatever the
order across stages, so a list-built order trains bitwise like the base one; the Schedule keeps the base's
name and says `order="list"`. Pure Python on floats, no randomness: every rank builds the same grid.

Straggler plan of bench/schedules.py (p=4, m=8, 8 stages in a loop, rank 1 2x slower): torch's zbinterleaved
order simulates at 1520 ms, the list-built one at 1480 ms (-2.6 %; a greedy allowed 10 pairs held until W instead
of 8 reaches 1456, which the held bound refuses); with equal times no variant beats the base.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional, Union

from model_parallel.errors import ScheduleError
from model_parallel.graph.in_flight import ZERO_BUBBLE_SCHEDULES
from model_parallel.optimizer.simulate import Simulation, StageTimes, simulate
from model_parallel.runtime.step.actions import FORWARD, INPUT, WEIGHT, Action, grid_from_orders
from model_parallel.runtime.step.schedule import Schedule, check

logger = logging.getLogger(__name__)

LIST, FIXED = "list", "fixed"
ORDERS = (LIST, FIXED)  # --schedule_order: list-built from stage times (default), or the schedule's fixed order
MARGIN = 0.005  # a list-built order must simulate this much faster than the base's to replace it
QUANTA = (0.05,)  # each variant is also built from the times rounded to 5 % of their median (`quantized`)
# The variants tried, in this order (the first of equals wins): the kind priority, F of the deeper stage first or
# not, how far under the base's bounds (in flight, held until W) the greedy keeps a rank (a greedy is myopic:
# forwarding less far ahead can leave room for the I's that free a slower rank), and whether a forward leaves room
# for the rank's deeper stages (without it a V or a loop often fills a rank with shallow forwards and deadlocks).
VARIANTS = tuple((priority, deep_first, under, reserve) for reserve in (False, True)
                 for under in ((0, 0), (1, 0), (0, 1), (1, 1), (2, 0))
                 for priority in ("IFW", "FIW") for deep_first in (True, False))


def simulate_schedule(schedule: Schedule, times: Sequence[StageTimes],
                      transfer_ms: Union[float, Sequence[float]] = 0.0) -> Simulation:
    """Simulate one of the runtime's schedule grids (its rows' orders, not its unit-time steps)."""
    rows = [schedule.row_actions(r) for r in range(schedule.num_rows)]
    return simulate(rows, [schedule.row_of(s) for s in range(schedule.num_stages)], times, transfer_ms)


def held_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per row: the most (stage, microbatch) pairs forwarded and not yet through their W (or B), walking its order."""
    peaks = []
    for r in range(schedule.num_rows):
        held = peak = 0
        for action in schedule.row_actions(r):
            held += 1 if action.is_forward else 0 if action.kind == INPUT else -1
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def list_orders(base: Schedule, times: Sequence[StageTimes], priority: str = "IFW", deep_first: bool = True,
                under: tuple[int, int] = (0, 0), reserve: bool = False) -> Optional[list[list[Action]]]:
    """Each row's order, list-built (see the module docstring) over `base`'s placement and bounds (`under`: that
    many pairs below the highest rank's in-flight and held bounds, on every rank; `reserve`: a forward leaves room for
    the rank's deeper stages); None when the greedy runs into its bounds with nothing left to start (that variant
    cannot be built)."""
    assert base.max_in_flight is not None, "only schedules with an in-flight bound are list-built"
    num_stages, m, rows = base.num_stages, base.num_microbatches, base.num_rows
    row_of = [base.row_of(s) for s in range(num_stages)]
    stages = [base.stages_of_row(r) for r in range(rows)]
    peaks = held_peaks(base)
    bound = [max(1, min(b, max(base.max_in_flight) - under[0])) for b in base.max_in_flight]
    held_bound = [max(1, min(b, max(peaks) - under[1])) for b in peaks]
    deeper = [sum(1 for t in stages[row_of[s]] if t > s) if reserve else 0 for s in range(num_stages)]
    done: dict[tuple[int, str, int], float] = {}  # (stage, F|I|W, microbatch) -> finish time
    following = {kind: [0] * num_stages for kind in "FIW"}  # per kind and stage: the next microbatch
    free, in_flight, held = [0.0] * rows, [0] * rows, [0] * rows
    orders: list[list[Action]] = [[] for _ in range(rows)]

    def ready(kind: str, s: int) -> Optional[float]:
        """When (kind, stage)'s next microbatch may start as far as its inputs go; None: not yet known."""
        j = following[kind][s]
        if j >= m:
            return None
        if kind == "F":
            deps = [(s - 1, "F", j)] if s > 0 else []
        elif kind == "I":
            deps = [(s, "F", j)] + ([(s + 1, "I", j)] if s < num_stages - 1 else [])
        else:
            deps = [(s, "I", j)]
        if any(d not in done for d in deps):
            return None
        return max((done[d] for d in deps), default=0.0)

    def rank_key(kind: str, s: int) -> tuple[int, int]:
        depth = -s if kind == "I" or (kind == "F" and deep_first) else s
        return priority.index(kind), depth

    def pick(r: int) -> Optional[tuple[float, str, int]]:
        """Row r's next action if it ran next: (start, kind, stage), or None when nothing of it can start yet."""
        picks = []
        for s in stages[r]:
            # `reserve`: a forward leaves room for the rank's deeper stages of a microbatch already in flight: their
            # I's (deepest first) are what free the room, so a rank full of shallow forwards would deadlock.
            room = 1 + deeper[s]
            for kind in "FIW":
                at = ready(kind, s)
                if at is not None and (kind != "F" or (in_flight[r] + room <= bound[r] and held[r] + room <= held_bound[r])):
                    picks.append((max(free[r], at), kind, s))
        if not picks:
            return None
        earliest = min(start for start, _, _ in picks)
        now = [p for p in picks if p[0] <= earliest * (1 + 1e-12)]  # a relative tie: the same on any time scale
        return min(now, key=lambda p: rank_key(p[1], p[2]))

    picks = [pick(r) for r in range(rows)]
    for _ in range(3 * num_stages * m):
        best: Optional[tuple[float, int, str, int]] = None  # (start, row, kind, stage)
        for r, candidate in enumerate(picks):
            if candidate is not None and (best is None or candidate[0] < best[0]):
                best = (candidate[0], r, candidate[1], candidate[2])
        if best is None:
            return None
        start, r, kind, s = best
        j = following[kind][s]
        following[kind][s] += 1
        done[(s, kind, j)] = free[r] = start + times[s].of(kind, s)
        in_flight[r] += {"F": 1, "I": -1, "W": 0}[kind]
        held[r] += {"F": 1, "I": 0, "W": -1}[kind]
        orders[r].append(Action(s, {"F": FORWARD, "I": INPUT, "W": WEIGHT}[kind], j))
        # Only this row and the rows its result feeds (the next stage's F, the previous stage's I) change.
        for row in {r} | {row_of[t] for t in (s - 1, s + 1) if 0 <= t < num_stages}:
            picks[row] = pick(row)
    return orders


def quantized(times: Sequence[StageTimes], share: float) -> list[StageTimes]:
    """`times` rounded to multiples of `share` x their median: measured times are never exactly equal, and a greedy
    that sees two stages as equal (one I as long as another's F) often builds the better order (every order is
    then judged on the true times)."""
    values = sorted(v for t in times for v in (t.forward_ms, t.input_ms or 0.0, t.weight_ms or 0.0))
    step = share * values[len(values) // 2]
    if step <= 0:
        return list(times)

    def grid(value: float) -> float:
        return round(value / step) * step

    return [StageTimes(grid(t.forward_ms), grid(t.input_ms or 0.0) + grid(t.weight_ms or 0.0), grid(t.input_ms or 0.0),
                       grid(t.weight_ms or 0.0)) for t in times]


def timed_schedule(base: Schedule, times: Optional[Sequence[StageTimes]]) -> Schedule:
    """`base` in a list-built order when one simulates more than `MARGIN` faster under `times` (per stage F, I, W ms
    of a microbatch), else `base` itself: never slower in simulation. Only the I/W-split schedules are
    reordered; the others, or times without an I/W split, return `base`."""
    if (times is None or base.name not in ZERO_BUBBLE_SCHEDULES or base.max_in_flight is None or base.order != FIXED
            or any(t.input_ms is None or t.weight_ms is None for t in times)):
        return base
    if len(times) != base.num_stages:
        raise ScheduleError(f"{base.name}: got stage times for {len(times)} stage(s), the schedule has {base.num_stages}")
    best, best_ms = base, simulate_schedule(base, times).makespan_ms
    base_ms = best_ms
    sources = [times] + [quantized(times, share) for share in QUANTA]
    for (priority, deep_first, under, reserve), built_from in itertools.product(VARIANTS, sources):
        orders = list_orders(base, built_from, priority, deep_first, under, reserve)
        if orders is None:
            continue
        built = replace(base, grid=grid_from_orders(orders, base.num_stages), order=LIST)
        try:
            check(built)
        except ScheduleError as error:  # a bug here: run the base order, and say so
            logger.error("the list-built %s order (%s) breaks a rule, not used: %s", base.name,
                         (priority, deep_first, under, reserve), str(error).splitlines()[0])
            continue
        makespan = simulate_schedule(built, times).makespan_ms
        if makespan < best_ms * (1 - MARGIN) if best is base else makespan < best_ms:
            best, best_ms = built, makespan
    if best is not base:
        logger.debug("%s: list-built order, simulated %.1f ms per step (the fixed order: %.1f)", base.name, best_ms,
                     base_ms)
    return best
