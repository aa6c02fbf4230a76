"""Zero-bubble schedules (Qi et al. 2024): the backward split into I (input gradient) and W (weight gradient).

I is what the stage before waits for; W can wait. ZB-H1 keeps 1F1B's order and memory (p-1-s warm-up
forwards on stage s, then one forward and one I), and defers W: stage s holds back its first s W's and
then runs one W after each I, the held-back ones at the end, where 1F1B's drain leaves stage s idle.
The input gradient reaches stage 0 after (p-1) I's instead of (p-1) full backwards, so with equal F, I
and W the idle time per rank drops from (p-1)(F+I+W) to (p-1)(F+I-W). p = 3, m = 4 (unit steps):

    step    0    1    2    3    4    5    6    7    8    9   10   11   12   13
    s0    0F0  0F1  0F2    .    .  0I0  0W0  0F3  0I1  0W1  0I2  0W2  0I3  0W3
    s1      .  1F0  1F1    .  1I0  1F2  1I1  1W0  1F3  1I2  1W1  1I3  1W2  1W3
    s2      .    .  2F0  2I0  2F1  2I1  2F2  2I2  2W0  2F3  2I3  2W1  2W2  2W3

The order is torch's `ScheduleInterleavedZeroBubble` with one stage per rank (`_get_1f1b_rank_ops`
with `enable_zero_bubble`), written for any v stages per rank in a loop: `zb_h1` is v = 1,
`zb_interleaved` v >= 2 (loop placement, as interleaved.py). `zb_v` is torch's `ScheduleZBVZeroBubble`:
two stages per rank in a V (rank r holds stages r and 2p-1-r), whose last rank hands stage p-1's
outputs to stage p without a message (runtime/wire/local.py). The runtime runs I and W with
runtime/step/backward_split.py (exact: the same gradients as B).
"""
from __future__ import annotations

from model_parallel.errors import ScheduleError
from model_parallel.graph.in_flight import microbatches_in_flight, zbv_in_flight, zero_bubble_in_flight, zero_bubble_warmup
from model_parallel.runtime.step.actions import FORWARD, INPUT, WEIGHT, Action, Schedule, grid_from_orders, loop_placement

NAME_H1 = "zbh1"
NAME_INTERLEAVED = "zbinterleaved"
NAME_V = "zbv"


def zero_bubble_orders(p: int, v: int, m: int) -> list[list[Action]]:
    """Each rank's order over its v stages (rank r holds stages r, r + p, ...): warm-up forwards, then one
    forward and one I, with a W after each I once rank r has held back r of them; then the held-back W's."""
    if p < 1 or v < 1 or m < 1:
        raise ScheduleError(f"a zero-bubble schedule needs p >= 1 ranks, v >= 1 stages per rank and m >= 1 "
                            f"microbatches, got p={p}, v={v}, m={m}")
    rounds = max(1, m // p)
    per_round = m // rounds
    if m % rounds:
        raise ScheduleError(f"zero bubble runs microbatches in {rounds} rounds of {per_round}: m={m} is not a "
                            f"multiple of {rounds}; use m={m - m % rounds}")
    total = v * m
    orders = []
    for r in range(p):
        warmup = zero_bubble_warmup(m, p, v, r)

        def forward_stage(op: int, r: int = r) -> int:
            return ((op // per_round) % v) * p + r

        def backward_stage(op: int, r: int = r, warmup: int = warmup) -> int:
            return (v - 1 - ((op - warmup) // per_round) % v) * p + r

        count: dict[tuple[int, str], int] = {}

        def next_action(stage: int, kind: str) -> Action:
            j = count.get((stage, kind), 0)
            count[(stage, kind)] = j + 1
            return Action(stage, kind, j)

        order: list[Action] = []
        backward_ops: list[int] = []  # the op number of each I, in order: the W's follow the same sequence
        weights = 0
        for op in range(total + warmup):  # warm-up, steady (F then I), cool-down (I)
            if op < total:
                order.append(next_action(forward_stage(op), FORWARD))
            if op >= warmup:
                order.append(next_action(backward_stage(op), INPUT))
                backward_ops.append(op)
                if op - warmup >= r:  # rank r holds back its first r W's (torch: num_1f1b_microbatches = rank)
                    order.append(next_action(backward_stage(backward_ops[weights]), WEIGHT))
                    weights += 1
        for op in backward_ops[weights:]:  # the held-back W's
            order.append(next_action(backward_stage(op), WEIGHT))
        orders.append(order)
    return orders


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: one stage per rank, 1F1B's memory (in flight: p - s on stage s), W's deferred into the drain."""
    grid = grid_from_orders(zero_bubble_orders(p, 1, m), p)
    bounds = tuple(microbatches_in_flight(NAME_H1, m, p, s) for s in range(p))
    return Schedule(NAME_H1, p, m, grid, flush=True, max_in_flight=bounds)


def zb_interleaved(p: int, v: int, m: int) -> Schedule:
    """Interleaved zero bubble: v stages per rank in a loop (stage k on rank k mod p), I and W split, torch's
    `ScheduleInterleavedZeroBubble` order; W's fill the bubbles interleaving leaves."""
    if p < 2 or v < 2:
        raise ScheduleError(f"the interleaved zero-bubble schedule needs p >= 2 ranks with v >= 2 stages each (loop "
                            f"placement), got p={p}, v={v}; use {NAME_H1} for one stage per rank")
    grid = grid_from_orders(zero_bubble_orders(p, v, m), p * v)
    bounds = tuple(zero_bubble_in_flight(m, p, v, r) for r in range(p))
    return Schedule(NAME_INTERLEAVED, p * v, m, grid, flush=True, max_in_flight=bounds, placement=loop_placement(p, v))


def v_placement(p: int) -> tuple[tuple[int, ...], ...]:
    """Rank r holds stages r and 2p-1-r (a V: down the ranks and back up); rank p-1 holds p-1 and p, handed over
    without a message."""
    return tuple((r, 2 * p - 1 - r) for r in range(p))


def zbv_orders(p: int, m: int) -> list[list[Action]]:
    """Each rank's order under ZBV (torch's `ScheduleZBVZeroBubble`): warm-up forwards of its first stage, then of
    both, then forward, I and W on its second; a steady phase of F, I, W on each; I's, then the W's left."""
    n = max(2 * p - 1, m)  # a full V needs 2p-1 microbatches; the ones past m are dropped below
    orders = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        order: list[Action] = []
        count = {(s, kind): 0 for s in (first, second) for kind in (FORWARD, INPUT, WEIGHT)}

        def add(*steps: tuple[int, str]) -> None:
            for stage, kind in steps:
                order.append(Action(stage, kind, count[(stage, kind)]))
                count[(stage, kind)] += 1

        f0, i0, w0 = (first, FORWARD), (first, INPUT), (first, WEIGHT)
        f1, i1, w1 = (second, FORWARD), (second, INPUT), (second, WEIGHT)
        add(*[f0] * (2 * (p - r) - 1))  # warm-up: the first stage, then both, then the second with its I and W
        add(*[f1, f0] * r)
        add(*[f1, i1, w1] * (p - r))
        while count[f1] < count[f0] or count[f0] < n:  # steady: F, I, W on each stage
            add(*([f0] if count[f0] < n else []), i0, w0, f1, i1, w1)
        add(*[i0, i1] * r)  # cool-down: the I's, the first stage's with its W, then the W's left
        add(*[i0, w0] * (p - r))
        add(*[w1] * (count[i1] - count[w1]))
        add(*[w0] * (count[i0] - count[w0]))
        orders.append([a for a in order if a.microbatch < m])
    return orders


def zb_v(p: int, m: int) -> Schedule:
    """ZBV: 2 stages per rank in a V (rank r: stages r and 2p-1-r), I and W split (Qi et al. 2024, torch's order)."""
    if p < 2 or m < 1:
        raise ScheduleError(f"the ZBV schedule needs p >= 2 ranks (2 stages each, in a V) and m >= 1 microbatches, "
                            f"got p={p}, m={m}; use {NAME_H1} for one stage per rank")
    grid = grid_from_orders(zbv_orders(p, m), 2 * p)
    bounds = tuple(zbv_in_flight(m, p, r) for r in range(p))
    return Schedule(NAME_V, 2 * p, m, grid, flush=True, max_in_flight=bounds, placement=v_placement(p))
