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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from model_parallel.errors import ScheduleError
from model_parallel.graph.in_flight import FLUSH_SCHEDULES, SCHEDULE_NAMES, microbatches_in_flight

FORWARD = "F"
BACKWARD = "B"  # the whole backward: input and weight gradients
INPUT = "I"  # zero bubble: the input gradient only (sent upstream at once; backward_split.py)
WEIGHT = "W"  # zero bubble: the weight gradient, after the I of the same microbatch
KINDS = (FORWARD, BACKWARD, INPUT, WEIGHT)
_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """Stage `stage` runs the forward ("F"), backward ("B"), or the backward's input ("I") or weight ("W")
    gradient alone, of microbatch `microbatch`."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"stage and microbatch must be >= 0, got stage {self.stage}, microbatch {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ScheduleError(f"cannot parse action {text!r}: expected <stage><F|B|I|W><microbatch>, e.g. 2F0")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    @property
    def sends_gradient(self) -> bool:
        """B or I: computes the input gradient (sent upstream) and ends the microbatch's activations' use."""
        return self.kind in (BACKWARD, INPUT)

    def provides(self) -> tuple[tuple[int, str, int], ...]:
        """What finishing it makes true: (stage, "F" forward | "G" input gradient | "W" weight gradient, j)."""
        phases = {FORWARD: "F", BACKWARD: "GW", INPUT: "G", WEIGHT: "W"}[self.kind]
        return tuple((self.stage, phase, self.microbatch) for phase in phases)


Grid = tuple[tuple[Optional[Action], ...], ...]


@dataclass(frozen=True)
class Schedule:
    """A stage-by-step grid of actions. `flush`: one optimizer step after all microbatches (GPipe,
    1F1B); without it (PipeDream async) each stage updates its weights after every backward."""

    name: str
    num_stages: int
    num_microbatches: int
    grid: Grid
    flush: bool = True
    max_in_flight: Optional[tuple[int, ...]] = None  # per row bound checked by `check` (graph/in_flight.py; 1F1B: p-s)
    # Row r holds these stages (several stages per rank); None: row s is stage s.
    placement: Optional[tuple[tuple[int, ...], ...]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(tuple(row) for row in self.grid))
        if self.placement is None:
            if len(self.grid) != self.num_stages:
                raise ScheduleError(f"{self.name}: grid has {len(self.grid)} row(s) for {self.num_stages} stage(s)")
            return
        placement = tuple(tuple(stages) for stages in self.placement)
        object.__setattr__(self, "placement", placement)
        if len(self.grid) != len(placement):
            raise ScheduleError(f"{self.name}: grid has {len(self.grid)} row(s) for a placement of {len(placement)} rank(s)")
        held = sorted(s for stages in placement for s in stages)
        if held != list(range(self.num_stages)):
            raise ScheduleError(f"{self.name}: the placement {placement} must hold each of stages 0..{self.num_stages - 1} "
                                f"on exactly one row, found {held}")

    @property
    def num_rows(self) -> int:
        """Ranks of the grid: one per stage, or fewer with several stages per rank."""
        return len(self.grid)

    def row_of(self, stage: int) -> int:
        """The row (rank) that runs `stage`."""
        if self.placement is None:
            return stage
        for row, stages in enumerate(self.placement):
            if stage in stages:
                return row
        raise ScheduleError(f"{self.name}: no row holds stage {stage} (stages 0..{self.num_stages - 1})")

    def stages_of_row(self, row: int) -> tuple[int, ...]:
        return (row,) if self.placement is None else self.placement[row]

    def row_actions(self, row: int) -> tuple[Action, ...]:
        """What one row (rank) runs, in order, over all the stages it holds (bubbles dropped)."""
        return tuple(a for a in self.grid[row] if a is not None)

    @property
    def num_steps(self) -> int:
        return max((len(row) for row in self.grid), default=0)

    def stage_actions(self, stage: int) -> tuple[Action, ...]:
        """What one stage runs, in order (bubbles dropped)."""
        return tuple(a for a in self.grid[self.row_of(stage)] if a is not None and a.stage == stage)

    def rank_actions(self, stage: int, replica: int = 0, num_replicas: int = 1) -> tuple[Action, ...]:
        """What one replica of a stage runs: microbatch j goes to replica j % num_replicas.

        A subsequence of a valid grid row, kept in grid order, is deadlock-free: every dependency
        of an action still sits at an earlier grid step.
        """
        return tuple(a for a in self.stage_actions(stage) if a.microbatch % num_replicas == replica)

    @property
    def bubble_fraction(self) -> float:
        busy = sum(1 for row in self.grid for a in row if a is not None)
        total = self.num_rows * self.num_steps
        return 1.0 - busy / total if total else 0.0


# ---- building schedules ---------------------------------------------------------------------
def _validate_sizes(p: int, m: int) -> None:
    if p < 1:
        raise ScheduleError(f"a pipeline needs at least 1 stage, got {p}")
    if m < 1:
        raise ScheduleError(f"a minibatch needs at least 1 microbatch, got {m}")


def _dependencies(action: Action, p: int) -> list[tuple[int, str, int]]:
    """What must be true first (`Action.provides` keys): the forward of the stage before; for B and I the
    own forward and the next stage's input gradient (its B or I); for W the own I."""
    s, j = action.stage, action.microbatch
    if action.is_forward:
        return [(s - 1, "F", j)] if s > 0 else []
    if action.kind == WEIGHT:
        return [(s, "G", j)]
    deps = [(s, "F", j)]
    if s < p - 1:
        deps.append((s + 1, "G", j))
    return deps


def _describe(key: tuple[int, str, int], stage: int) -> str:
    s, phase, j = key
    if phase == "F":
        return "its own forward" if s == stage else f"{s}F{j} (data from stage {s})"
    if s == stage:
        return f"its own input gradient ({s}I{j})"
    return f"{s}B{j} or {s}I{j} (the gradient from stage {s})"


def grid_from_orders(orders: Sequence[Sequence[Action]], p: int) -> Grid:
    """Place per-row action orders (one row per stage, or per rank holding several of the p stages)
    on unit time steps as early as dependencies allow."""
    rows = len(orders)
    time_of: dict[Action, int] = {}
    done_at: dict[tuple[int, str, int], int] = {}  # Action.provides keys -> step
    cursor = [0] * rows
    positions = [0] * rows
    row_of: dict[Action, int] = {}
    total = sum(len(o) for o in orders)
    while len(time_of) < total:
        progressed = False
        for s in range(rows):
            while positions[s] < len(orders[s]):
                action = orders[s][positions[s]]
                deps = _dependencies(action, p)
                if any(d not in done_at for d in deps):
                    break
                t = max([cursor[s]] + [done_at[d] + 1 for d in deps])
                time_of[action] = t
                done_at.update((key, t) for key in action.provides())
                row_of[action] = s
                cursor[s] = t + 1
                positions[s] += 1
                progressed = True
        if not progressed:
            stuck = [str(orders[s][positions[s]]) for s in range(rows) if positions[s] < len(orders[s])]
            raise ScheduleError(f"per-{'stage' if rows == p else 'rank'} orders deadlock: waiting actions {stuck}")
    steps = max(time_of.values()) + 1 if time_of else 0
    grid: list[list[Optional[Action]]] = [[None] * steps for _ in range(rows)]
    for action, t in time_of.items():
        grid[row_of[action]][t] = action
    return tuple(tuple(row) for row in grid)


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (increasing microbatch order), flush."""
    _validate_sizes(p, m)
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
    _validate_sizes(p, m)
    return Schedule("1f1b", p, m, grid_from_orders(_one_f_one_b_orders(p, m), p), flush="1f1b" in FLUSH_SCHEDULES,
                    max_in_flight=_in_flight_bounds("1f1b", p, m))


def pipedream_async(p: int, m: int) -> Schedule:
    """PipeDream's asynchronous 1F1B with weight stashing over a stream of m microbatches (no flush)."""
    _validate_sizes(p, m)
    return Schedule("pipedream", p, m, grid_from_orders(_one_f_one_b_orders(p, m), p),
                    flush="pipedream" in FLUSH_SCHEDULES, max_in_flight=_in_flight_bounds("pipedream", p, m))


def _in_flight_bounds(name: str, p: int, m: int) -> tuple[int, ...]:
    """The bound `check` enforces per stage: the rule the optimizer's memory model counts with (one rank per stage)."""
    return tuple(microbatches_in_flight(name, m, p, s) for s in range(p))


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe, "pipedream": pipedream_async}
MULTI_STAGE = ("interleaved",)  # several stages per rank: built by interleaved.run_schedule, which knows the ranks


def _factories() -> dict[str, Callable[[int, int], Schedule]]:
    """Every one-stage-per-rank schedule by name: `(p, m) -> Schedule`, pure. zero_bubble.py builds on this module."""
    from model_parallel.runtime.step.zero_bubble import NAME_H1, zb_h1

    factories = {**SCHEDULES, NAME_H1: zb_h1}
    assert set(factories) | set(MULTI_STAGE) == set(SCHEDULE_NAMES), "graph/in_flight.py names the schedules"
    return factories


def make_schedule(name: str, p: int, m: int) -> Schedule:
    """Schedule `name` over p stages (one per rank) and m microbatches; "interleaved" (several stages per
    rank) is built by `interleaved.run_schedule`, which knows the ranks."""
    try:
        factory = _factories()[name]
    except KeyError:
        if name == "interleaved":
            raise ScheduleError("the interleaved schedule places stages on ranks in a loop: build it with "
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
    lines = [f"{schedule.name} p={schedule.num_stages}{ranks} m={schedule.num_microbatches}", header]
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
            for key in action.provides():
                if key in done_at:
                    what = {"F": "forward", "G": "input gradient", "W": "weight gradient"}[key[1]]
                    _fail(schedule, t, f"{action}: the {what} of stage {s}, microbatch {key[2]} runs twice "
                                       f"(first at step {done_at[key]}; a backward is B, or I then W)")
                expected = done[(s, key[1])]
                if action.microbatch != expected:
                    _fail(schedule, t, f"{action}: stage {s} must run {action.kind} of microbatch {expected} next "
                                       "(microbatches run in increasing order)")
            for dep in _dependencies(action, p):
                if dep not in done_at:
                    _fail(schedule, t, f"{action} runs before {_describe(dep, s)}")
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
