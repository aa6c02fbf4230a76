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
    reader = csv.reader(io.StringIO(text))
    count = 0
    try:
        for line, row in enumerate(reader, 1):
            order: list[Action] = []
            for column, raw in enumerate(row, 1):
                cell = raw.strip()
                if not cell:
                    continue
                order.extend(_action(cell, f"{where}:{line}: cell {column} ({cell[:40]!r})"))
            count += len(order)
            if count > MAX_ACTIONS:
                raise ScheduleError(f"{where}:{line}: more than {MAX_ACTIONS} actions by this row; a schedule this "
                                    "size is not one a pipeline runs (fewer microbatches per step, or fewer ranks)")
            orders.append(order)
    except csv.Error as error:  # a field over csv's limit (128 KiB), a NUL byte: not a cell of a schedule
        raise ScheduleError(f"{where}:{reader.line_num}: not a schedule CSV row ({error}); expected rows like "
                            "'0F0,0F1,,0B0', one row per rank") from None
    while orders and not orders[-1]:
        orders.pop()  # trailing blank lines
    if not orders or not any(orders):
        raise ScheduleError(f"{where}: no actions found (expected rows like '0F0,0F1,,0B0', one row per rank)")
    p = len(orders)
    m = 1 + max(a.microbatch for order in orders for a in order)
    placement = _placement(orders, where)
    num_stages = sum(len(stages) for stages in placement)
    _check_orders(orders, placement, m, where)
    own_rows = all(stages == (rank,) for rank, stages in enumerate(placement))
    try:
        schedule = Schedule(name, num_stages, m, grid_from_orders(orders, num_stages),
                            placement=None if own_rows else placement)
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


def _check_orders(orders: list[list[Action]], placement: tuple[tuple[int, ...], ...], m: int, where: str) -> None:
    """Each stage runs the forward, the input gradient (B or I) and the weight gradient (B or W) of microbatches
    0..m-1 once each, in increasing order (how this runtime matches messages between two ranks): the first cell
    that breaks it is named, before any placing on time steps."""
    phases = (("F", "forward", "F"), ("G", "backward", "B"), ("W", "weight gradient", "W"))
    # One pass buckets each action under what it provides: filtering a row once per stage was quadratic
    # (a row of 100k cells, each its own stage, took minutes).
    buckets: dict[tuple[int, str], list[Action]] = defaultdict(list)
    for order in orders:
        for action in order:
            for stage, phase, _ in action.provides():
                buckets[stage, phase].append(action)
    counted = [(rank, stage, what, default, buckets.get((stage, phase), []))
               for rank in range(len(orders)) for stage in placement[rank] for phase, what, default in phases]
    for rank, stage, what, _, actions in counted:
        for k, action in enumerate(actions):
            if action.microbatch != k:
                raise ScheduleError(f"{where}:{rank + 1}: {action} is stage {stage}'s {what} number {k}; "
                                    f"expected {stage}{action.kind}{k} (microbatches run in increasing order, each once)")
    for rank, stage, what, default, actions in counted:
        if len(actions) < m:
            raise ScheduleError(f"{where}:{rank + 1}: {stage}{default}{len(actions)} never runs (every stage runs the "
                                f"{what} of each of the {m} microbatches)")


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
