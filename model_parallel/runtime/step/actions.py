"""Schedule data: actions like `2F0` (stage, kind, microbatch), a grid of them per row, and their dependencies.

Kinds: F forward, B the whole backward, or the backward split in two for zero-bubble schedules: I the
input gradient (what the stage before waits for) and W the weight gradient (runtime/step/backward_split.py).
`grid_from_orders` places per-row orders on unit time steps as early as the dependencies allow;
schedule.py builds the named schedules and checks them by rules, zero_bubble.py the split ones.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from model_parallel.errors import ScheduleError

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
    # "fixed": the named schedule's own order; "list": each row's order list-built from stage times (list_order.py)
    order: str = "fixed"

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


# ---- placing actions on unit time steps ---------------------------------------------------------
def validate_sizes(p: int, m: int) -> None:
    if p < 1:
        raise ScheduleError(f"a pipeline needs at least 1 stage, got {p}")
    if m < 1:
        raise ScheduleError(f"a minibatch needs at least 1 microbatch, got {m}")


def dependencies(action: Action, p: int) -> list[tuple[int, str, int]]:
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


def describe_dependency(key: tuple[int, str, int], stage: int) -> str:
    s, phase, j = key
    if phase == "F":
        return "its own forward" if s == stage else f"{s}F{j} (data from stage {s})"
    if s == stage:
        return f"its own input gradient ({s}I{j})"
    return f"{s}B{j} or {s}I{j} (the gradient from stage {s})"


class OrdersDeadlock(ScheduleError):
    """`grid_from_orders` found no row able to run its next action; `positions[r]`: the index in row r's order of
    the action it waits at (len(order) where the row is done), for a caller that can name cells (schedule_csv.py)."""

    def __init__(self, message: str, positions: list[int]) -> None:
        super().__init__(message)
        self.positions = positions


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
                deps = dependencies(action, p)
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
            raise OrdersDeadlock(f"per-{'stage' if rows == p else 'rank'} orders deadlock: waiting actions {stuck}",
                                 list(positions))
    steps = max(time_of.values()) + 1 if time_of else 0
    grid: list[list[Optional[Action]]] = [[None] * steps for _ in range(rows)]
    for action, t in time_of.items():
        grid[row_of[action]][t] = action
    return tuple(tuple(row) for row in grid)


def loop_placement(p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Rank r holds stages r, r + p, ..., r + (v-1) p: stage k runs on rank k mod p."""
    return tuple(tuple(c * p + r for c in range(v)) for r in range(p))
