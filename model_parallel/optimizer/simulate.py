"""A schedule simulator: per-rank action orders + per-stage times -> every action's start and finish, the makespan, the bubble.

Pure and deterministic, so the runtime's `--schedule auto` chooser, the optimizer and the coordinator
price a schedule the same way. A schedule is given as its rows (one per rank, each the actions that
rank runs, in order; `Schedule.row_actions` in runtime/step/schedule.py) and `stage_rows`, the row
that holds each stage. An action is anything with `stage`, `kind` and `microbatch`; its kind is

    F  forward                 after F(s-1, j) (+ the transfer over edge s-1 when s-1 sits on another row)
    B  full backward           after F(s, j) and B|I(s+1, j) (+ the transfer over edge s)
    I  input-gradient backward the same dependencies as B
    W  weight-gradient         after I(s, j) on the same stage (no message)

A row runs one action at a time, in its order: an action starts when its row is free and its
dependencies have finished (list scheduling). Transfers are per edge (edge s: stage s -> s+1, the same
time forward and backward) and cost nothing between two stages on one row. An edge carries one message
at a time each way (a link's bandwidth is shared: GPipe's stream of forwards queues on a slow link); the
sending rank is not busy meanwhile (sends are asynchronous). p = 4, m = 4, F = B = 1:

    1F1B  makespan 2 (m + p - 1) = 14, each rank busy 8: bubble 6 / 14 = 43 %
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from model_parallel.errors import ScheduleError

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


class ActionLike(Protocol):
    """What the simulator reads of an action (runtime.step.schedule.Action has it)."""

    @property
    def stage(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def microbatch(self) -> int: ...


@dataclass(frozen=True)
class StageTimes:
    """One microbatch's compute on one stage, in ms: forward, full backward, and (for I/W-split schedules)
    the input-gradient and weight-gradient parts (None: the stage's split is not known)."""

    forward_ms: float
    backward_ms: float
    input_ms: Optional[float] = None
    weight_ms: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("forward_ms", "backward_ms", "input_ms", "weight_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ScheduleError(f"StageTimes.{name} must be a finite number of ms >= 0, got {value}")

    def of(self, kind: str, stage: int) -> float:
        """The time of one action of `kind` on this stage."""
        if kind == FORWARD:
            return self.forward_ms
        if kind == BACKWARD:
            return self.backward_ms
        value = self.input_ms if kind == INPUT_GRAD else self.weight_ms if kind == WEIGHT_GRAD else None
        if kind not in KINDS:
            raise ScheduleError(f"action kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if value is None:
            raise ScheduleError(f"stage {stage} runs {kind} actions but its times give no {kind} split (input_ms and "
                                "weight_ms); give StageTimes(input_ms=..., weight_ms=...) for I/W-split schedules")
        return value


Key = tuple[int, str, int]  # (stage, kind, microbatch)


@dataclass(frozen=True)
class Simulation:
    """The simulated step: each action's (start, finish) in ms, the makespan, and per row its busy ms and bubble."""

    times: Mapping[Key, tuple[float, float]]
    makespan_ms: float
    busy_ms: tuple[float, ...]

    @property
    def bubbles(self) -> tuple[float, ...]:
        """Per row (rank): idle / makespan."""
        if self.makespan_ms <= 0:
            return tuple(0.0 for _ in self.busy_ms)
        return tuple(1.0 - busy / self.makespan_ms for busy in self.busy_ms)

    @property
    def bubble(self) -> float:
        """The mean bubble over the rows: the share of all ranks' time spent idle."""
        return sum(self.bubbles) / len(self.bubbles) if self.bubbles else 0.0


def _key(action: ActionLike) -> Key:
    return (int(action.stage), str(action.kind), int(action.microbatch))


def _dependencies(key: Key, num_stages: int, has_split: frozenset[int]) -> list[Key]:
    """What must finish before `key` starts (messages are priced by the caller)."""
    s, kind, j = key
    if kind == FORWARD:
        return [(s - 1, FORWARD, j)] if s > 0 else []
    if kind == WEIGHT_GRAD:
        return [(s, INPUT_GRAD, j)]
    deps = [(s, FORWARD, j)]
    if s < num_stages - 1:  # the gradient from downstream: its I where it splits its backward, else its B
        deps.append((s + 1, INPUT_GRAD if s + 1 in has_split else BACKWARD, j))
    return deps


def simulate(rows: Sequence[Sequence[ActionLike]], stage_rows: Sequence[int], times: Sequence[StageTimes],
             transfer_ms: Union[float, Sequence[float]] = 0.0) -> Simulation:
    """Run the rows' orders as early as dependencies and one-action-at-a-time allow (see the module docstring).

    `stage_rows[s]`: the row holding stage s; `times[s]`: stage s's action times; `transfer_ms`: one
    number for every edge, or one per edge s -> s+1 (p - 1 of them). Raises ScheduleError on a deadlock."""
    p = len(stage_rows)
    if len(times) != p:
        raise ScheduleError(f"got times for {len(times)} stage(s), the schedule has {p}")
    edges = [float(transfer_ms)] * max(p - 1, 0) if isinstance(transfer_ms, (int, float)) else [float(t) for t in transfer_ms]
    if len(edges) != max(p - 1, 0) or any(not (math.isfinite(t) and t >= 0) for t in edges):
        raise ScheduleError(f"transfer_ms: give one time >= 0 for every edge ({max(p - 1, 0)}), got {transfer_ms!r}")
    orders = [[_key(a) for a in row] for row in rows]
    for r, order in enumerate(orders):
        for s, _, _ in order:
            if not 0 <= s < p or stage_rows[s] != r:
                raise ScheduleError(f"row {r} runs an action of stage {s}, which row "
                                    f"{stage_rows[s] if 0 <= s < p else '?'} holds (stages 0..{p - 1})")
    has_split = frozenset(s for order in orders for s, kind, _ in order if kind == INPUT_GRAD)
    finish: dict[Key, float] = {}
    start: dict[Key, float] = {}
    free = [0.0] * len(orders)
    link_free: dict[tuple[int, bool], float] = {}  # (edge, forward?) -> when its last message has arrived
    busy = [0.0] * len(orders)
    positions = [0] * len(orders)
    total = sum(len(order) for order in orders)
    while len(finish) < total:
        progressed = False
        for r, order in enumerate(orders):
            while positions[r] < len(order):
                key = order[positions[r]]
                deps = _dependencies(key, p, has_split)
                if any(d not in finish for d in deps):
                    break
                ready = free[r]
                for d in deps:
                    if d[0] == key[0] or stage_rows[d[0]] == r:  # the same stage, or a hand-off on this rank
                        ready = max(ready, finish[d])
                        continue
                    # One message at a time per edge and direction, in the order sent (a stage sends its
                    # forwards, and its backwards, in microbatch order: the order they are received here).
                    link = (min(d[0], key[0]), d[0] < key[0])
                    arrival = max(finish[d], link_free.get(link, 0.0)) + edges[link[0]]
                    link_free[link] = arrival
                    ready = max(ready, arrival)
                duration = times[key[0]].of(key[1], key[0])
                start[key], finish[key] = ready, ready + duration
                free[r] = ready + duration
                busy[r] += duration
                positions[r] += 1
                progressed = True
        if not progressed:
            waiting = [f"{s}{k}{j}" for r, order in enumerate(orders) if positions[r] < len(order)
                       for s, k, j in [order[positions[r]]]]
            raise ScheduleError(f"the rows' orders deadlock: waiting actions {waiting}")
    return Simulation(times={k: (start[k], finish[k]) for k in finish}, makespan_ms=max(free, default=0.0),
                      busy_ms=tuple(busy))
