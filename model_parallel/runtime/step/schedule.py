"""Pipeline schedules as data: actions like `2F0`, a stage-by-step grid, and rule checks without processes.

A schedule is a grid: row s lists what stage s does at each unit time step (`None` = bubble).
With several stages per rank (`placement`, interleaved.py) row r lists what rank r does, the actions
of all the stages it holds.
With p = 3 stages and m = 4 microbatches, 1F1B with a flush per minibatch reads

    step    0    1    2    3    4    5    6    7    8    9
    s0    0F0  0F1  0F2   .    .  0B0  0F3  0B1   .  0B2  0B3 ...

(`format_grid` prints it). Every schedule here runs forwards in increasing microbatch order and
backwards in increasing microbatch order on every stage: the runtime's point-to-point messages
between two ranks are matched in that order.

Schedules:
- `gpipe(p, m)`: all forwards, then all backwards; one optimizer step after the flush.
- `one_f_one_b(p, m)` (default): stage s runs min(p-1-s, m) warm-up forwards, then alternates
  one forward and one backward, then drains; at most p-s microbatches in flight on stage s (so
  activation memory is bounded by p-s microbatches instead of m); one optimizer step after the flush.
- `pipedream_async(p, m)`: PipeDream's asynchronous 1F1B. The same per-stage order as 1F1B but
  there is no flush: the microbatches are a continuous stream and every stage applies an optimizer
  update after each backward (each microbatch is a minibatch). With weight stashing, stage s runs
  the forward of microbatch j on weight version `max(0, j - (p-1-s))` (the number of updates it
  has applied by then) and stashes that version so the backward of j uses the same weights. So
  the staleness at stage s is p-1-s updates (0 on the last stage), forward and backward of one
  microbatch are consistent within a stage, and different stages see different versions
  (PipeDream without vertical sync). `weight_version(schedule, s, j)` computes it from the grid.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Optional

from model_parallel.errors import ScheduleError
from model_parallel.graph.in_flight import FLUSH_SCHEDULES, MULTI_STAGE_SCHEDULES, SCHEDULE_NAMES, microbatches_in_flight
# Re-exported: the schedule's data types live in actions.py (zero_bubble.py builds on them without this module).
from model_parallel.runtime.step.actions import (BACKWARD, FORWARD, INPUT, KINDS, WEIGHT, Action, Grid,  # noqa: F401
                                                 Schedule, dependencies, describe_dependency, grid_from_orders,
                                                 validate_sizes)


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (increasing microbatch order), flush."""
    validate_sizes(p, m)
    orders = [[Action(s, FORWARD, j) for j in range(m)] + [Action(s, BACKWARD, j) for j in range(m)] for s in range(p)]
    return Schedule("gpipe", p, m, grid_from_orders(orders, p), flush="gpipe" in FLUSH_SCHEDULES,
                    max_in_flight=_in_flight_bounds("gpipe", p, m))


def _one_f_one_b_orders(p: int, m: int) -> list[list[Action]]:
    orders = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        order = [Action(s, FORWARD, j) for j in range(warmup)]
        for i in range(m - warmup):
            order += [Action(s, FORWARD, warmup + i), Action(s, BACKWARD, i)]
        order += [Action(s, BACKWARD, j) for j in range(m - warmup, m)]
        orders.append(order)
    return orders


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B with a flush per minibatch (PipeDream-Flush / Megatron's non-interleaved schedule)."""
    validate_sizes(p, m)
    return Schedule("1f1b", p, m, grid_from_orders(_one_f_one_b_orders(p, m), p), flush="1f1b" in FLUSH_SCHEDULES,
                    max_in_flight=_in_flight_bounds("1f1b", p, m))


def pipedream_async(p: int, m: int) -> Schedule:
    """PipeDream's asynchronous 1F1B with weight stashing over a stream of m microbatches (no flush)."""
    validate_sizes(p, m)
    return Schedule("pipedream", p, m, grid_from_orders(_one_f_one_b_orders(p, m), p),
                    flush="pipedream" in FLUSH_SCHEDULES, max_in_flight=_in_flight_bounds("pipedream", p, m))


def _in_flight_bounds(name: str, p: int, m: int) -> tuple[int, ...]:
    """The bound `check` enforces per stage: the rule the optimizer's memory model counts with (one rank per stage)."""
    return tuple(microbatches_in_flight(name, m, p, s) for s in range(p))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"1f1b": one_f_one_b, "gpipe": gpipe, "pipedream": pipedream_async}
MULTI_STAGE = MULTI_STAGE_SCHEDULES  # several stages per rank: built by interleaved.run_schedule, which knows the ranks


def _factories() -> dict[str, Callable[[int, int], Schedule]]:
    """Every one-stage-per-rank schedule by name: `(p, m) -> Schedule`, pure. zero_bubble.py builds on this module."""
    from model_parallel.runtime.step.zero_bubble import NAME_H1, zb_h1

    factories: dict[str, Callable[[int, int], Schedule]] = {**SCHEDULES, NAME_H1: zb_h1}
    assert set(factories) | set(MULTI_STAGE) == set(SCHEDULE_NAMES), "graph/in_flight.py names the schedules"
    return factories


def make_schedule(name: str, p: int, m: int) -> Schedule:
    """Schedule `name` over p stages (one per rank) and m microbatches; "interleaved" (several stages per
    rank) is built by `interleaved.run_schedule`, which knows the ranks."""
    try:
        factory = _factories()[name]
    except KeyError:
        if name in MULTI_STAGE:
            raise ScheduleError(f"the {name} schedule places stages on ranks in a loop: build it with "
                                "runtime.step.interleaved.run_schedule(name, stages, m, num_ranks)") from None
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}") from None
    return factory(p, m)


def weight_version(schedule: Schedule, stage: int, microbatch: int) -> int:
    """Without a flush: how many updates stage `stage` applied before the forward of `microbatch`
    (the stashed version its backward reuses). With a flush every microbatch sees version 0."""
    if schedule.flush:
        return 0
    done = 0
    for action in schedule.stage_actions(stage):
        if action == Action(stage, FORWARD, microbatch):
            return done
        if not action.is_forward:
            done += 1
    raise ScheduleError(f"{schedule.name}: stage {stage} never runs the forward of microbatch {microbatch}")


# ---- text -----------------------------------------------------------------------------------
def format_grid(schedule: Schedule, mark: Optional[int] = None) -> str:
    """A stage-by-step table; `mark` puts a `^` under one step (used by `check` to show a failure)."""
    width = max([len(str(a)) for row in schedule.grid for a in row if a is not None] + [4]) + 1
    header = "step " + "".join(f"{t:>{width}}" for t in range(schedule.num_steps))
    label = "s" if schedule.placement is None else "r"  # rows are stages, or ranks holding several
    ranks = "" if schedule.placement is None else f" ranks={schedule.num_rows}"
    order = "" if schedule.order == "fixed" else f" order={schedule.order}"  # list-built from stage times (list_order.py)
    lines = [f"{schedule.name} p={schedule.num_stages}{ranks} m={schedule.num_microbatches}{order}", header]
    for s, row in enumerate(schedule.grid):
        cells = "".join(f"{str(a) if a is not None else '.':>{width}}" for a in row)
        lines.append(f"{label}{s:<4}" + cells)
    if mark is not None:
        lines.append(" " * (5 + width * mark + width - 1) + "^")
    return "\n".join(lines)


def parse_grid(text: str, name: str = "custom", flush: bool = True) -> Schedule:
    """Read a grid back: rows `s<k> <action|.> ...` (header lines are skipped)."""
    rows: list[list[Optional[Action]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or not re.match(r"^s\d+$", fields[0]):
            continue
        if int(fields[0][1:]) != len(rows):
            raise ScheduleError(f"line {number}: expected row s{len(rows)}, found {fields[0]}")
        rows.append([None if f == "." else Action.parse(f) for f in fields[1:]])
    if not rows:
        raise ScheduleError("no grid rows found (expected lines like 's0 0F0 0F1 . 0B0')")
    microbatches = {a.microbatch for row in rows for a in row if a is not None}
    return Schedule(name, len(rows), max(microbatches) + 1 if microbatches else 0, tuple(map(tuple, rows)), flush=flush)


# ---- rules ------------------------------------------------------------------------------------
def _fail(schedule: Schedule, step: int, message: str) -> None:
    raise ScheduleError(f"{schedule.name}: step {step}: {message}\n{format_grid(schedule, mark=step)}")


def check(schedule: Schedule) -> None:
    """Validate a schedule by rules; raise `ScheduleError` naming the first failing step.

    Rules: actions sit on the row of their stage (its own row, or the rank holding it) and name a
    valid microbatch; each stage runs every microbatch's F once and its backward once, whole (B) or
    split (I, then W); forwards, input gradients (B or I) and weight gradients (B or W) each in
    increasing microbatch order; F(s, j) after F(s-1, j); B or I of (s, j) after F(s, j) and after the
    B or I of (s+1, j); W(s, j) after I(s, j); and, where the schedule has an in-flight bound
    (graph/in_flight.py; 1F1B: p - s), a row never holds more (stage, microbatch) pairs forwarded and
    not yet through B or I (a W holds only what its weight gradient needs).
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    done_at: dict[tuple[int, str, int], int] = {}  # Action.provides keys -> step
    ran: dict[Action, int] = {}
    done = {(s, phase): 0 for s in range(p) for phase in "FGW"}  # per stage and phase: microbatches done so far
    in_flight = [0] * schedule.num_rows
    # Walk steps in time order so the first violation reported is the earliest one.
    for t in range(schedule.num_steps):
        for r, row in enumerate(schedule.grid):
            action = row[t] if t < len(row) else None
            if action is None:
                continue
            s = action.stage
            if s >= p or schedule.row_of(s) != r:
                where = f"stage {r}'s row" if schedule.placement is None else f"rank {r}'s row (it holds stages {schedule.stages_of_row(r)})"
                _fail(schedule, t, f"{action} is on {where}")
            if action.microbatch >= m:
                _fail(schedule, t, f"{action}: microbatch {action.microbatch} out of range 0..{m - 1}")
            if action in ran:
                _fail(schedule, t, f"{action} runs twice (first at step {ran[action]})")
            ran[action] = t
            for key in action.provides():
                if key in done_at:
                    what = {"F": "forward", "G": "input gradient", "W": "weight gradient"}[key[1]]
                    _fail(schedule, t, f"{action}: the {what} of stage {s}, microbatch {key[2]} runs twice "
                                       f"(first at step {done_at[key]}: a backward is B, or I then W)")
                expected = done[(s, key[1])]
                if action.microbatch != expected:
                    _fail(schedule, t, f"{action}: stage {s} must run {action.kind} of microbatch {expected} next "
                                       "(microbatches run in increasing order)")
            for dep in dependencies(action, p):
                if dep not in done_at:
                    _fail(schedule, t, f"{action} runs before {describe_dependency(dep, s)}")
            for key in action.provides():
                done_at[key] = t
                done[(s, key[1])] += 1
            in_flight[r] += 1 if action.is_forward else -1 if action.sends_gradient else 0
            if schedule.max_in_flight is not None and in_flight[r] > schedule.max_in_flight[r]:
                holder = f"stage {s}" if schedule.placement is None else f"rank {r}"
                _fail(schedule, t, f"{holder} holds {in_flight[r]} microbatches in flight, above the "
                                   f"{schedule.name.upper()} bound {schedule.max_in_flight[r]} (graph/in_flight.py)")
    for s in range(p):
        for j in range(m):
            for phase, what in (("F", f"{s}F{j}"), ("G", f"{s}B{j} (or {s}I{j})"), ("W", f"{s}B{j} (or {s}W{j})")):
                if (s, phase, j) not in done_at:
                    raise ScheduleError(f"{schedule.name}: {what} never runs (stage {s} must run F and B, or F, I "
                                        f"and W, of every microbatch 0..{m - 1})\n{format_grid(schedule)}")
