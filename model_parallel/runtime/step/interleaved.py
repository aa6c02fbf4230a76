"""Interleaved 1F1B (Megatron's virtual pipeline): v stages per rank in a loop, as a checked grid of rank rows.

Rank r of p holds stages r, r + p, ..., r + (v-1) p (loop placement), so a microbatch crosses every
rank v times. The model is cut into p*v stages; each action (`5F2`: stage 5, forward, microbatch 2)
is ~1/v of a rank's work, and the bubble shrinks from (p-1)/(m+p-1) to (p-1)/(v m+p-1). Rank r's
order (Megatron `forward_backward_pipelining_with_interleaving`, torch `ScheduleInterleaved1F1B`):
forward number k (k = 0 .. v m - 1) runs local stage c = (k mod p v) div p on microbatch
(k div p v) p + k mod p, so microbatches go through a local stage in rounds of p; backward number k
runs local stage v-1-c on the same microbatch; warm-up forwards (graph/in_flight.interleaved_warmup),
then one forward and one backward, then the remaining backwards. p = 2, v = 2, m = 2 (stages 0..3):

    step     0    1    2    3    4    5    6    7    8    9
    r0     0F0  0F1  2F0  2F1    .  2B0    .  2B1  0B0  0B1
    r1       .  1F0  1F1  3F0  3B0  3F1  3B1  1B0  1B1    .

Needs m a multiple of p (Megatron and torch refuse the same): within a round every rank's stage waits
on the same p microbatches. Every stage still runs its forwards and backwards in increasing
microbatch order, the rule the runtime's message matching relies on (schedule.check).

The runtime runs it with `--schedule interleaved` (`run_schedule`): a rank builds all its stages and
runs its row (engine.py, multi_stage.py), the plan in loop placement (runtime/plancheck.py).
"""
from __future__ import annotations

from typing import Optional

from model_parallel.errors import ScheduleError
from model_parallel.graph.in_flight import MULTI_STAGE_SCHEDULES, interleaved_in_flight, interleaved_order
from model_parallel.runtime.step.actions import loop_placement  # noqa: F401  (re-exported: its home before zero bubble)
from model_parallel.runtime.step.schedule import BACKWARD, FORWARD, Action, Schedule, grid_from_orders, make_schedule
from model_parallel.runtime.step.zero_bubble import NAME_INTERLEAVED, NAME_V, zb_interleaved, zb_v

NAME = "interleaved"


def _validate(p: int, v: int, m: int) -> None:
    if p < 1 or v < 1 or m < 1:
        raise ScheduleError(f"interleaved 1F1B needs p >= 1 ranks, v >= 1 stages per rank and m >= 1 microbatches, "
                            f"got p={p}, v={v}, m={m}")
    if m % p:
        raise ScheduleError(f"interleaved 1F1B runs microbatches in rounds of p={p}: m={m} is not a multiple of p; "
                            f"use m={m + p - m % p} (or {m - m % p})" if m > p else
                            f"interleaved 1F1B runs microbatches in rounds of p={p}: m={m} is not a multiple of p; "
                            f"use m={p}")


def interleaved_orders(p: int, v: int, m: int) -> list[list[Action]]:
    """Each rank's action order over its v stages (Megatron's order: graph/in_flight.interleaved_order)."""
    _validate(p, v, m)
    return [[Action(c * p + r, FORWARD if forward else BACKWARD, j) for c, forward, j in interleaved_order(m, p, v, r)]
            for r in range(p)]


def interleaved_1f1b(p: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B over p ranks with v stages each (p*v stages, loop placement), flush per minibatch."""
    grid = grid_from_orders(interleaved_orders(p, v, m), p * v)
    bounds = tuple(interleaved_in_flight(m, p, v, r) for r in range(p))
    return Schedule(NAME, p * v, m, grid, flush=True, max_in_flight=bounds, placement=loop_placement(p, v))


def analytic_bubble(p: int, v: int, m: int) -> float:
    """The idle share of a rank with unit-time actions: (p-1) / (v m + p-1) (v = 1: 1F1B's (p-1) / (m+p-1))."""
    return (p - 1) / (v * m + p - 1)


def run_schedule(name: str, num_stages: int, m: int, num_ranks: int) -> Schedule:
    """The schedule a run uses: `make_schedule`'s, or Interleaved 1F1B (or its zero-bubble form) over `num_ranks`
    ranks holding num_stages / num_ranks stages each (loop placement; runtime/plancheck.py checks the plan first)."""
    if name not in MULTI_STAGE_SCHEDULES:
        return make_schedule(name, num_stages, m)
    if name == NAME_V:
        if num_stages != 2 * num_ranks:
            raise ScheduleError(f"the {name} schedule places 2 stages per rank in a V: {num_stages} stage(s) on "
                                f"{num_ranks} rank(s) is not 2 per rank; give --num_stages {2 * num_ranks} (PipelineTrainer(num_stages=...))")
        return zb_v(num_ranks, m)
    if num_ranks < 1 or num_stages % num_ranks:
        raise ScheduleError(f"the {name} schedule places {num_stages} stage(s) on ranks in a loop: the ranks must "
                            f"divide them, got {num_ranks}")
    if name == NAME_INTERLEAVED:
        return zb_interleaved(num_ranks, num_stages // num_ranks, m)
    return interleaved_1f1b(num_ranks, num_stages // num_ranks, m)


def world_refusal(name: str, world_size: int, num_microbatches: int) -> Optional[str]:
    """Why schedule `name` cannot run m microbatches on `world_size` ranks, or None if it can. One stage per rank runs
    on any world; the several-stages-per-rank ones are asked of their builder, the one owner of their rules
    (interleaved 1F1B: >= 2 ranks and m a multiple of them; zbinterleaved and zbv: >= 2 ranks, m in equal rounds)."""
    if name not in MULTI_STAGE_SCHEDULES:
        return None
    if world_size < 2:  # plancheck.check_placement's rule (one rank would hand stage to stage without a message)
        return f"the {name} schedule places several stages on each of >= 2 ranks; this world has {world_size}"
    try:
        run_schedule(name, 2 * world_size, num_microbatches, world_size)
    except ScheduleError as error:
        return str(error)
    return None
