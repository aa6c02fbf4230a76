"""`model-parallel schedule NAME|FILE.csv`: a schedule's grid, bubble and in-flight peak; torch's CSV in and out.

    model-parallel schedule 1f1b -p 4 -m 8                 # our schedule's grid on unit time steps
    model-parallel schedule 1f1b -p 4 -m 8 --csv 1f1b.csv  # written in torch.distributed.pipelining's CSV format
    model-parallel schedule interleaved -p 4 -v 2 -m 8     # Interleaved 1F1B: 4 ranks, 2 stages each (rank rows)
    model-parallel schedule zbh1 -p 4 -m 8                 # ZB-H1: the backward split into I and W
    model-parallel schedule zbinterleaved -p 4 -v 2 -m 8   # interleaved zero bubble (torch's InterleavedZeroBubble)
    model-parallel schedule zbv -p 4 -m 8                  # ZBV: 2 stages per rank in a V (torch's ZBVZeroBubble)
    model-parallel schedule torch_order.csv                # a torch CSV checked by our rules (exit 2 naming the step)
    model-parallel schedule 1f1b -p 4 -m 8 --times 10,20 --transfer_ms 1   # simulated in ms (optimizer/simulate.py)
    model-parallel schedule zbinterleaved -p 4 -m 8 --times 32,32,32/32,32,32/...  # zero bubble: the order a run
                                                           # list-builds from these times (--order fixed: torch's)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from model_parallel.cli.common import ArgumentParser
from model_parallel.errors import ConfigError
from model_parallel.fileio import check_output_path
from model_parallel.graph.in_flight import MULTI_STAGE_SCHEDULES, SCHEDULE_NAMES, V_SCHEDULES
from model_parallel.runtime.step.interleaved import run_schedule
from model_parallel.runtime.step.schedule import Schedule, format_grid, make_schedule
from model_parallel.runtime.step.schedule_csv import MAX_ACTIONS, read_torch_csv, write_torch_csv


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per row (stage, or rank holding several), the most (stage, microbatch) pairs forwarded and not yet
    backwarded at once (what their activations cost)."""
    peaks = []
    for r in range(schedule.num_rows):
        held = peak = 0
        for action in schedule.row_actions(r):
            held += 1 if action.is_forward else -1 if action.sends_gradient else 0  # W: activations are gone
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


MAX_TIME_MS = 1e9  # per action: the simulated step (a sum of many) stays finite and printable


def parse_times(text: str, num_stages: int) -> list[Any]:
    """`--times F,B` or `F,I,W` (every stage), or one such group per stage separated by '/': per-microbatch ms, as
    `StageTimes` (F,I,W: the backward split into input and weight gradients, for the zero-bubble schedules)."""
    from model_parallel.errors import ScheduleError
    from model_parallel.optimizer.simulate import StageTimes

    try:
        groups = [tuple(float(x) for x in part.split(",")) for part in text.split("/")]
    except ValueError:
        groups = []
    if not groups or any(len(g) not in (2, 3) for g in groups) or len(groups) not in (1, num_stages):
        raise ConfigError(f"--times {text!r}: give forward,backward (e.g. 10,20) or forward,input-grad,weight-grad "
                          f"(10,10,10) ms of one microbatch for every stage, or one group per stage separated by '/' "
                          f"({num_stages} stages)")
    if any(abs(x) > MAX_TIME_MS for g in groups for x in g):  # 1e308 is finite, but a step of them sums to inf
        raise ConfigError(f"--times {text!r}: a time above {MAX_TIME_MS:.0e} ms (11 days) per microbatch; give ms "
                          "of one microbatch (e.g. 10,20)")
    try:
        times = [StageTimes(g[0], g[1]) if len(g) == 2 else StageTimes(g[0], g[1] + g[2], g[1], g[2]) for g in groups]
    except (ValueError, ScheduleError) as error:
        raise ConfigError(f"--times {text!r}: {error}") from None
    return times * num_stages if len(times) == 1 else times


def _check_size(args: Any) -> None:
    """A named schedule's grid is built, checked and printed whole: `-p 100000 -m 100000` ran for minutes towards
    tens of GB. The bound is the one the CSV reader keeps (MAX_ACTIONS), counting F, I and W of every pair."""
    stages = args.stages * (args.stages_per_rank if args.schedule in MULTI_STAGE_SCHEDULES else 1)
    actions = 3 * max(stages, 0) * max(args.microbatches, 0)
    if actions > MAX_ACTIONS:
        raise ConfigError(f"{args.schedule} -p {args.stages} -m {args.microbatches}: {stages} stage(s) x "
                          f"{args.microbatches} microbatches is up to {actions:,} actions, more than the {MAX_ACTIONS:,} "
                          "this command checks; give fewer stages or microbatches")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print a schedule (one of ours, or torch's CSV checked by our rules); --csv writes it in torch's format."""
    parser = ArgumentParser(prog="model-parallel schedule", description=main.__doc__)
    parser.add_argument("schedule", help=f"one of {', '.join(SCHEDULE_NAMES)}, or a torch schedule CSV "
                        "(compute-only format)")
    parser.add_argument("-p", "--stages", type=int, default=4, help="stages = ranks, for a named schedule (default 4; "
                        "interleaved: ranks)")
    parser.add_argument("-v", "--stages_per_rank", type=int, default=2, help="interleaved schedules only: stages per "
                        "rank (default 2)")
    parser.add_argument("-m", "--microbatches", type=int, default=8, help="microbatches, for a named schedule (default 8)")
    parser.add_argument("--csv", help="write the schedule here in torch's CSV format (torch's _load_csv reads it)")
    parser.add_argument("--times", help="also simulate it with these ms per microbatch: forward,backward (or forward,"
                        "input-grad,weight-grad for the zero-bubble schedules) for every "
                        "stage (10,20) or one group per stage separated by '/' (10,20/30,60/...)")
    parser.add_argument("--transfer_ms", type=float, default=0.0, help="with --times: ms to send one microbatch's "
                        "values over a stage edge, each way (default 0)")
    parser.add_argument("--order", choices=("list", "fixed"), default="list", help="with --times, zero bubble: the "
                        "order a run list-builds from the times where it simulates faster (default), or torch's")
    args = parser.parse_args(argv)
    if args.csv:  # a directory there was a traceback after the grid was printed
        check_output_path(args.csv, ConfigError, "--csv")
    if args.schedule in V_SCHEDULES:
        args.stages_per_rank = 2
    if args.schedule in SCHEDULE_NAMES:
        _check_size(args)
    if args.schedule in MULTI_STAGE_SCHEDULES:  # -p ranks, -v stages each (zbv: 2)
        schedule = run_schedule(args.schedule, args.stages * args.stages_per_rank, args.microbatches, args.stages)
    elif args.schedule in SCHEDULE_NAMES:
        schedule = make_schedule(args.schedule, args.stages, args.microbatches)
    else:
        schedule = read_torch_csv(args.schedule)  # a ScheduleError: exit 2 with the file, row and step
    times = None if args.times is None else parse_times(args.times, schedule.num_stages)
    if times is not None and any(a is not None and a.kind in ("I", "W") for row in schedule.grid for a in row) and any(
            t.input_ms is None for t in times):
        raise ConfigError(f"--times {args.times!r}: the {schedule.name} schedule splits the backward into I and W: "
                          "give forward,input-grad,weight-grad ms per stage (e.g. 10,10,10)")
    if times is not None and args.order == "list":  # what a run with these stage times runs (runtime/step/list_order.py)
        from model_parallel.runtime.step.list_order import timed_schedule

        schedule = timed_schedule(schedule, times)
    print(format_grid(schedule))
    rows = "stage" if schedule.placement is None else "rank"
    print(f"bubble {100 * schedule.bubble_fraction:.1f} % of {schedule.num_rows} x {schedule.num_steps} unit steps "
          f"(every action, F, B, I or W, one unit long); peak microbatches in flight per {rows}: "
          f"{peak_in_flight(schedule)}")
    if times is not None:
        from model_parallel.runtime.step.auto import simulate_schedule

        result = simulate_schedule(schedule, times, args.transfer_ms)
        print(f"simulated: {result.makespan_ms:.1f} ms per step, bubble {100 * result.bubble:.1f} % (per {rows}: "
              f"{', '.join(f'{100 * b:.1f}' for b in result.bubbles)} %)")
    if args.csv:
        print(f"wrote {write_torch_csv(schedule, args.csv)}")
    return 0
