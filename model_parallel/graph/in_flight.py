"""The schedules' names and how many microbatches a stage holds in flight: one rule, shared below everyone.

The runtime's schedules (runtime/step/schedule.py: their grids and the bound `check` enforces), the
optimizer's memory model (optimizer/memory.py: activations and stashed weights a stage holds) and the
command lines' `--schedule` choices all read them here, so a prediction and a run never disagree on it.

For a stage after `ranks_before` of the pipeline's `num_ranks` ranks, on `replicas` replicas that are
dealt the microbatches round-robin, with m microbatches per minibatch:

    gpipe      ceil(m / r)                                all forwards run before any backward
    1f1b       min(ceil((M - before) / r), ceil(m / r))   warm-up forwards, then one forward per backward
    pipedream  ceil((M - before) / r)                     1F1B with no flush: the stream never drains
    interleaved  min(2 (M - before), ceil(m / r))         per stage, M = all stages, before = its position (loop)
    zbinterleaved as interleaved                           per stage, loop placement (its grids stay under it)
    zbv        min(M - before, ceil(m / r))               per stage, V placement, M = all stages
    zbh1       as 1f1b                                    ZB-H1: 1F1B's warm-up; an I ends a microbatch's
                                                          activations, its deferred W keeps only the weight path's

With one rank per stage, stage s of p holds p - s (1F1B capped by m) — the grids' bound. The interleaved
row bounds a stage of the Interleaved 1F1B grid for every p, v, m (tests/unit/graph/test_in_flight.py
checks it against the grids); the optimizer prices each of a rank's stages by it.

Interleaved 1F1B (v stages per rank in a loop: rank r holds stages r, r + p, ...; runtime/step/interleaved.py)
counts (stage, microbatch) pairs on a rank, as Megatron's warm-up does:

    interleaved  min(2 (p - 1 - r) + (v - 1) p + 1, v m)   pairs held by rank r of p (each pair ~ 1/v of its layers)

Memory is another count under zero bubble (`activations_held`, `zero_bubble_pairs_held`): the bound above ends
a microbatch at its I (the schedule's rule, what `check` enforces), but our I keeps the microbatch's autograd graph
(retain_graph) for its W, so its saved activations, and the gradients kept at the weights' inputs, live until its W.
Walking the orders (tests/unit/graph/test_in_flight.py): ZB-H1 then holds min(p, m) on every stage (stage s: its
p - s plus the s W's it holds back), zbinterleaved the same number of pairs on every rank, rank 0's count above
(so (v - 1) per_round + p, capped by v m), and ZBV's W follows its I (no change).

A rank's bytes at its peak are not the sum of its stages' peaks (they need not coincide): `interleaved_peak`
walks the rank's order (`interleaved_order`, the one rule runtime/step/interleaved.py builds its grid from),
each forward adding its stage's bytes per microbatch, each backward freeing them.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

SCHEDULE_NAMES = ("1f1b", "gpipe", "pipedream", "interleaved", "zbh1", "zbinterleaved", "zbv")  # the first: the default
FLUSH_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbh1", "zbinterleaved", "zbv")  # one update per minibatch
LOOP_SCHEDULES = ("interleaved", "zbinterleaved")  # several stages per rank, stage k on rank k mod p
V_SCHEDULES = ("zbv",)  # two stages per rank in a V: rank r holds stages r and 2p-1-r (replica i: + i*p)
MULTI_STAGE_SCHEDULES = LOOP_SCHEDULES + V_SCHEDULES
ZERO_BUBBLE_SCHEDULES = ("zbh1", "zbinterleaved", "zbv")  # the backward split into I and W


def microbatches_in_flight(schedule: str, num_microbatches: int, num_ranks: int, ranks_before: int,
                           replicas: int = 1) -> int:
    """Microbatches whose saved activations one replica of the stage holds at its peak (see the table above)."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if schedule == "gpipe":
        return math.ceil(num_microbatches / replicas)
    if schedule in LOOP_SCHEDULES:  # ranks = stage positions; a replica runs a subsequence of the row: its j % r
        return min(2 * (num_ranks - ranks_before), math.ceil(num_microbatches / replicas))
    if schedule in V_SCHEDULES:  # a replica runs a subsequence of the V's rows: the whole grid's bound, or its share
        return min(num_ranks - ranks_before, math.ceil(num_microbatches / replicas))
    downstream = math.ceil((num_ranks - ranks_before) / replicas)
    if schedule == "pipedream":
        return downstream
    return min(downstream, math.ceil(num_microbatches / replicas))


def activations_held(schedule: str, num_microbatches: int, num_ranks: int, ranks_before: int, replicas: int = 1) -> int:
    """Microbatches whose activations one replica of the stage keeps at its peak (the memory model's count): the
    in-flight bound, except under ZB-H1, where a microbatch through its I keeps them until its W (see above)."""
    if schedule == "zbh1":
        return min(math.ceil(num_ranks / replicas), math.ceil(num_microbatches / replicas))
    return microbatches_in_flight(schedule, num_microbatches, num_ranks, ranks_before, replicas)


def zero_bubble_pairs_held(num_microbatches: int, num_ranks: int, stages_per_rank: int, replicas: int = 1) -> int:
    """(stage, microbatch) pairs whose activations a rank keeps at its peak under zbinterleaved (until their W):
    rank 0's in-flight count, on every rank; a replica of r runs 1/r of the microbatches."""
    share = math.ceil(num_microbatches / replicas)
    return min(zero_bubble_in_flight(num_microbatches, num_ranks, stages_per_rank, 0), stages_per_rank * share)


def interleaved_warmup(num_microbatches: int, num_ranks: int, stages_per_rank: int, rank: int) -> int:
    """Forwards rank `rank` runs before its first backward under Interleaved 1F1B (Megatron's count)."""
    return min(2 * (num_ranks - 1 - rank) + (stages_per_rank - 1) * num_ranks, stages_per_rank * num_microbatches)


def interleaved_in_flight(num_microbatches: int, num_ranks: int, stages_per_rank: int, rank: int) -> int:
    """(stage, microbatch) pairs whose activations rank `rank` holds at its peak under Interleaved 1F1B."""
    return min(interleaved_warmup(num_microbatches, num_ranks, stages_per_rank, rank) + 1,
               stages_per_rank * num_microbatches)


def zero_bubble_warmup(num_microbatches: int, num_ranks: int, stages_per_rank: int, rank: int) -> int:
    """Forwards rank `rank` runs before its first I under the zero-bubble schedules (torch's count: one round of
    microbatches per extra stage, plus one per rank after it; v = 1 is 1F1B's p - 1 - r)."""
    per_round = num_microbatches // max(1, num_microbatches // num_ranks)
    return min((stages_per_rank - 1) * per_round + num_ranks - 1 - rank, stages_per_rank * num_microbatches)


def zero_bubble_in_flight(num_microbatches: int, num_ranks: int, stages_per_rank: int, rank: int) -> int:
    """(stage, microbatch) pairs forwarded and not yet through I on rank `rank` at its peak (zero bubble)."""
    return min(zero_bubble_warmup(num_microbatches, num_ranks, stages_per_rank, rank) + 1,
               stages_per_rank * num_microbatches)


def zbv_in_flight(num_microbatches: int, num_ranks: int, rank: int) -> int:
    """(stage, microbatch) pairs forwarded and not yet through I on rank `rank` at its peak under ZBV."""
    return min(2 * num_ranks, 2 * num_microbatches)


def interleaved_order(num_microbatches: int, num_ranks: int, stages_per_rank: int, rank: int) -> list[tuple[int, bool, int]]:
    """Rank `rank`'s actions under Interleaved 1F1B as (local stage c, is forward, microbatch), Megatron's order:
    forward number k runs local stage (k mod p v) div p on microbatch (k div p v) p + k mod p, backward number k
    local stage v - 1 - that on the same microbatch; warm-up forwards, then one forward and one backward, then the
    remaining backwards (stage c of rank r is stage c p + r)."""
    p, v = num_ranks, stages_per_rank
    total, warmup = v * num_microbatches, interleaved_warmup(num_microbatches, p, v, rank)

    def action(k: int, forward: bool) -> tuple[int, bool, int]:
        c = (k % (p * v)) // p
        return (c if forward else v - 1 - c), forward, (k // (p * v)) * p + k % p

    order = [action(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action(warmup + i, True), action(i, False)]
    return order + [action(k, False) for k in range(total - warmup, total)]


def interleaved_peak(num_microbatches: int, num_ranks: int, rank: int, per_microbatch: Sequence[float],
                     replica: int = 0, replicas: int = 1) -> float:
    """The most bytes rank `rank` holds at once under Interleaved 1F1B, `per_microbatch[c]` the bytes one microbatch
    keeps on its local stage c (v = len(per_microbatch)); replica i of r runs the microbatches j with j % r == i."""
    held = peak = 0.0
    for c, forward, j in interleaved_order(num_microbatches, num_ranks, len(per_microbatch), rank):
        if j % replicas == replica:
            held += per_microbatch[c] if forward else -per_microbatch[c]
            peak = max(peak, held)
    return peak
