"""torch.distributed.pipelining's schedule CSV ("compute_only" format), read and written, checked by our rules.

torch writes one row per rank, each cell an action such as `0F0` (stage 0, forward, microbatch 0) or
`1B3` (full backward), `""` where a rank idles, and `0REDUCE_GRAD` after a stage's last backward
(`PipelineScheduleMulti._dump_csv` / `_load_csv`). A row is an order, not a clock: torch itself
drops the idle cells before running it. We read the per-rank orders, place them on unit time steps
as early as their dependencies allow (`schedule.grid_from_orders`) and check the result with
`schedule.check`, so a file that would deadlock or skip a microbatch is refused at the step where it
goes wrong. A row may hold several stages (torch's Interleaved1F1B: rank r runs stages r and r + p):
the placement is read off the rows, each stage on exactly one row. What this runtime cannot run is
refused by name: the "compute_comms" format (explicit SEND/RECV actions). The split backward (`I` input
gradient, `W` weight gradient; torch's zero-bubble schedules) is read and checked like B (zero_bubble.py).
Errors name the line and cell (the file's column): a cell written twice, an action before one of its own row
that it waits for (with the rule), and for rows that wait on each other each stuck cell and what it waits for.
"""
from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional, Union

from model_parallel.errors import ScheduleError
from model_parallel.fileio import atomic_write_text
from model_parallel.userfile import read_text
from model_parallel.runtime.step.actions import OrdersDeadlock, dependencies
from model_parallel.runtime.step.schedule import Action, Schedule, check, grid_from_orders

MAX_CSV_BYTES = 16 * 2**20  # a schedule of 1000 ranks x 10,000 actions fits; a bigger file is not a schedule
# Checking costs ~12 us an action (~12 s here for this many): 128 ranks x 4 stages x 512 microbatches x F, I, W fit.
MAX_ACTIONS = 1_000_000
# At most 9 digits: a stage or microbatch number, never a 5000-digit integer to convert.
_CELL = re.compile(r"^(\d{1,9})(F|B|I|W|REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B)(\d{0,9})$")
_IGNORED = ("REDUCE_GRAD", "UNSHARD", "RESHARD")  # bookkeeping torch schedules around compute; ours does it after the flush


def read_torch_csv(path: Union[str, Path], name: Optional[str] = None) -> Schedule:
    """A torch compute-only schedule CSV as our `Schedule` (flush after every minibatch), checked by our rules."""
    source = Path(path)
    text = read_text(source, error=ScheduleError, what="schedule CSV", max_bytes=MAX_CSV_BYTES,
                     fix="give torch's schedule CSV")
    return parse_torch_csv(text, name or source.stem, where=str(source))


def parse_torch_csv(text: str, name: str = "csv", where: str = "<csv>") -> Schedule:
    """`read_torch_csv` on text; errors name `where`, the line (= rank + 1) and the cell."""
    orders: list[list[Action]] = []
    columns: list[list[int]] = []  # the cell (1-based column) of each action of `orders`
    reader = csv.reader(io.StringIO(text))
    count = 0
    try:
        for line, row in enumerate(reader, 1):
            order: list[Action] = []
            cells: list[int] = []
            for column, raw in enumerate(row, 1):
                cell = raw.strip()
                if not cell:
                    continue
                order.extend(_action(cell, f"{where}:{line}: cell {column} ({cell[:40]!r})"))
                cells.extend([column] * (len(order) - len(cells)))
            count += len(order)
            if count > MAX_ACTIONS:
                raise ScheduleError(f"{where}:{line}: more than {MAX_ACTIONS} actions by this row; a schedule this "
                                    "size is not one a pipeline runs (fewer microbatches per step, or fewer ranks)")
            orders.append(order)
            columns.append(cells)
    except csv.Error as error:  # a field over csv's limit (128 KiB), a NUL byte: not a cell of a schedule
        raise ScheduleError(f"{where}:{reader.line_num}: not a schedule CSV row ({error}); expected rows like "
                            "'0F0,0F1,,0B0', one row per rank") from None
    while orders and not orders[-1]:
        orders.pop()  # trailing blank lines
    if not orders or not any(orders):
        raise ScheduleError(f"{where}: no actions found (expected rows like '0F0,0F1,,0B0', one row per rank)")
    idle = next((rank for rank, order in enumerate(orders) if not order), None)
    if idle is not None:  # was read as a rank running nothing: another rank count, stage placement and bubble
        raise ScheduleError(f"{where}:{idle + 1}: line {idle + 1} holds no action, so rank {idle} would run no stage "
                            "(each line is one rank's order): delete the blank line, or give that rank its actions")
    m = 1 + max(a.microbatch for order in orders for a in order)
    placement = _placement(orders, where)
    num_stages = sum(len(stages) for stages in placement)
    _check_orders(orders, placement, m, where, columns)
    own_rows = all(stages == (rank,) for rank, stages in enumerate(placement))
    try:
        schedule = Schedule(name, num_stages, m, grid_from_orders(orders, num_stages),
                            placement=None if own_rows else placement)
    except OrdersDeadlock as error:
        raise ScheduleError(_deadlock(orders, columns, placement, error.positions, where)) from None
    except ScheduleError as error:
        raise ScheduleError(f"{where}: {error}") from None
    check(schedule)
    return schedule


def _placement(orders: list[list[Action]], where: str) -> tuple[tuple[int, ...], ...]:
    """The stages each row runs; a stage on two rows, or stages that are not 0..n-1, is refused by name."""
    placement = tuple(tuple(sorted({a.stage for a in order})) for order in orders)
    seen: dict[int, int] = {}
    for rank, stages in enumerate(placement):
        for stage in stages:
            if stage in seen:
                raise ScheduleError(f"{where}:{rank + 1}: rank {rank} runs stage {stage}, which rank {seen[stage]} runs: "
                                    "a stage runs on one rank (replicas are not written in a schedule)")
            seen[stage] = rank
    missing = sorted(set(range(len(seen))) - set(seen))
    if missing:
        raise ScheduleError(f"{where}: no row runs stage(s) {missing}; stages are numbered 0..{len(seen) - 1} "
                            f"(found {sorted(seen)})")
    return placement


_WHAT = {"F": "forward", "G": "input gradient", "W": "weight gradient"}
# Why an action waits for one on its own row (dependencies()): the rule a cell after it breaks.
_RULE = {"F": "a forward comes after the forward of the stage before",
         "BF": "a backward (B or I) comes after its own forward",
         "BG": "a backward (B or I) comes after the input gradient of the stage after (its B or I)",
         "W": "a weight gradient comes after its own input gradient (I, then W)"}


def _check_orders(orders: list[list[Action]], placement: tuple[tuple[int, ...], ...], m: int, where: str,
                  columns: Optional[list[list[int]]] = None) -> None:
    """Each stage runs the forward, the input gradient (B or I) and the weight gradient (B or W) of microbatches
    0..m-1 once each, in increasing order (how this runtime matches messages between two ranks), and no action
    comes before one of its own row that it waits for: the first cell that breaks it is named, before any placing
    on time steps. `columns`: the cell of each action (default its place in the row's order)."""
    phases = (("F", "forward", "F"), ("G", "backward", "B"), ("W", "weight gradient", "W"))
    row_of = {stage: rank for rank, stages in enumerate(placement) for stage in stages}
    p = len(row_of)
    # One pass buckets each action under what it provides, with its cell: filtering a row once per stage was
    # quadratic (a row of 100k cells, each its own stage, took minutes). The same pass finds the first action that
    # waits for a later one of its own row (a deadlock whatever the other rows do).
    buckets: dict[tuple[int, str], list[tuple[Action, int]]] = defaultdict(list)
    early: Optional[tuple[int, Action, int, tuple[int, str, int]]] = None  # (rank, action, cell, what it waits for)
    for rank, order in enumerate(orders):
        provided: set[tuple[int, str, int]] = set()
        for action, column in zip(order, columns[rank]) if columns is not None else zip(order, range(1, len(order) + 1)):
            if early is None:
                for dep in dependencies(action, p):
                    if row_of.get(dep[0]) == rank and dep not in provided:
                        early = (rank, action, column, dep)
                        break
            for key in action.provides():
                buckets[key[0], key[1]].append((action, column))
                provided.add(key)
    counted = [(rank, stage, phase, what, default, buckets.get((stage, phase), []))
               for rank in range(len(orders)) for stage in placement[rank] for phase, what, default in phases]
    for rank, stage, phase, what, _, actions in counted:
        for k, (action, column) in enumerate(actions):
            if action.microbatch < k:  # its microbatch ran already (the k actions before are 0..k-1 in order)
                first, at = actions[action.microbatch]
                if first == action:
                    raise ScheduleError(f"{where}:{rank + 1}: {action} appears twice on line {rank + 1} (cells {at} and "
                                        f"{column}): delete one")
                raise ScheduleError(f"{where}:{rank + 1}: cell {column}: {action} runs the {_WHAT[phase]} of stage "
                                    f"{stage}, microbatch {action.microbatch} again, after {first} (cell {at}): a "
                                    "backward is B, or I then W: delete one")
            if action.microbatch != k:
                raise ScheduleError(f"{where}:{rank + 1}: {action} is stage {stage}'s {what} number {k}; "
                                    f"expected {stage}{action.kind}{k} (microbatches run in increasing order, each once)")
    if early is not None:
        rank, action, column, dep = early
        waited = [(a, c) for a, c in buckets.get((dep[0], dep[1]), []) if a.microbatch == dep[2]]
        if waited:  # else it never runs: named below
            rule = _RULE[action.kind if action.kind in "FW" else "B" + dep[1]]
            raise ScheduleError(f"{where}:{rank + 1}: cell {column}: {action} runs before {waited[0][0]} (cell "
                                f"{waited[0][1]}), which it waits for: {rule}")
    for rank, stage, _, what, default, actions in counted:
        if len(actions) < m:
            raise ScheduleError(f"{where}:{rank + 1}: {stage}{default}{len(actions)} never runs (every stage runs the "
                                f"{what} of each of the {m} microbatches)")


def _deadlock(orders: list[list[Action]], columns: list[list[int]], placement: tuple[tuple[int, ...], ...],
              positions: list[int], where: str, shown: int = 4) -> str:
    """Why no row can go on (`grid_from_orders` stopped at `positions`): each stuck row's cell, the action on another
    row it waits for, and the stuck action that row runs it after; then the rows that wait on each other."""
    row_of = {stage: rank for rank, stages in enumerate(placement) for stage in stages}
    p = len(row_of)
    # Where each (stage, phase, microbatch) is run, once per error: a row's actions are placed in order, so one
    # at or after its row's stuck position is not done.
    at = {key: (rank, i) for rank, order in enumerate(orders) for i, action in enumerate(order) for key in action.provides()}
    stuck = [rank for rank in range(len(orders)) if positions[rank] < len(orders[rank])]
    lines, waits_on = [], {}
    for rank in stuck:
        action = orders[rank][positions[rank]]
        dep = next((d for d in dependencies(action, p) if d in at and at[d][1] >= positions[at[d][0]]), None)
        if dep is None:  # not a wait on another row (_check_orders refuses the others): say what is known
            return f"{where}: the rows deadlock at {[str(orders[r][positions[r]]) for r in stuck]}"
        other, i = at[dep]
        waits_on[rank] = other
        ahead = (", itself waiting" if i == positions[other] else f", which line {other + 1} runs only after "
                 f"{orders[other][positions[other]]} (cell {columns[other][positions[other]]})")
        lines.append(f"line {rank + 1}, cell {columns[rank][positions[rank]]}: {action} waits for {orders[other][i]} "
                     f"(line {other + 1}, cell {columns[other][i]}){ahead}")
    cycle, rank = [], stuck[0]
    while rank not in cycle:  # every stuck row waits on a stuck row: following them from any one comes back
        cycle.append(rank)
        rank = waits_on[rank]
    cycle = cycle[cycle.index(rank):]
    rows = (f"lines {cycle[0] + 1} and {cycle[1] + 1} wait on each other" if len(cycle) == 2 else
            f"lines {' -> '.join(str(r + 1) for r in cycle + cycle[:1])} wait on each other in a circle")
    more = f"; and {len(lines) - shown} more line(s) waiting" if len(lines) > shown else ""
    return (f"{where}:{stuck[0] + 1}: the rows deadlock, none can run its next action: " + "; ".join(lines[:shown])
            + f"{more}: {rows}; reorder one of them to run the action the other waits for first")


def _action(cell: str, at: str) -> list[Action]:
    """The action a cell holds ([] for bookkeeping cells), or a refusal naming what is not supported."""
    match = _CELL.match(cell)
    if match is None:
        if cell.startswith("("):
            raise ScheduleError(f"{at}: overlapped sub-actions are not supported; write one action per cell")
        raise ScheduleError(f"{at}: not an action; expected <stage><F|B|I|W><microbatch>, e.g. 0F0 or 1B3")
    stage, kind, microbatch = int(match.group(1)), match.group(2), match.group(3)
    if kind in _IGNORED:
        return []
    if kind.startswith(("SEND", "RECV")):
        raise ScheduleError(f"{at}: an explicit communication action: this is torch's 'compute_comms' format; "
                            "give the compute-only schedule (F and B actions, as PipelineScheduleMulti._dump_csv writes)")
    if not microbatch:
        raise ScheduleError(f"{at}: the action names no microbatch")
    return [Action(stage, kind, int(microbatch))]


def torch_csv_text(schedule: Schedule) -> str:
    """Our schedule in torch's compute-only format: row k = rank k's actions on their time steps, "" for bubbles."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in schedule.grid:
        cells = [str(a) if a is not None else "" for a in row]
        writer.writerow(cells + [""] * (schedule.num_steps - len(cells)))
    return out.getvalue()


def write_torch_csv(schedule: Schedule, path: Union[str, Path]) -> Path:
    """Write `torch_csv_text(schedule)` atomically (torch's `_load_csv` reads it)."""
    return atomic_write_text(path, torch_csv_text(schedule))
