"""The schedule a re-formed world runs (`--recover`, an admission): the one asked for when it fits the new world size,
else the one-stage-per-rank flush schedule with the same updates (docs/reliability.md, "Schedules on a new world").

interleaved, zbinterleaved and zbv place several stages per rank: they need >= 2 ranks, and interleaved 1F1B m a
multiple of them (zbinterleaved and zbv: m in equal rounds; `interleaved.world_refusal` asks their builders). A
4-worker interleaved job with m=8 that loses a worker cannot run interleaved on 3, so that world runs 1f1b (zbinterleaved
and zbv: zbh1, where their rounds do not fit either). Every flush schedule applies one update per
minibatch from the same gradients (up to the order they are summed in), so the run stays the same training; the
checkpoint records the schedule asked for (TrainConfig.schedule_asked), and a later world that fits runs it again.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any, Optional

from model_parallel.runtime.step.interleaved import world_refusal
from model_parallel.runtime.step.schedule import MULTI_STAGE_SCHEDULES

logger = logging.getLogger(__name__)

# One stage per rank, the same math: interleaved 1F1B -> 1F1B, the zero-bubble ones -> ZB-H1 (split backward kept).
STAND_IN = {"interleaved": "1f1b", "zbinterleaved": "zbh1", "zbv": "zbh1"}


def stand_in(schedule: str, world_size: int, num_microbatches: int) -> tuple[str, Optional[str]]:
    """(the schedule a re-formed world of `world_size` runs, the line saying why it is not `schedule`, or None)."""
    refusal = world_refusal(schedule, world_size, num_microbatches)
    if refusal is None:
        return schedule, None
    instead = STAND_IN[schedule]
    rule = refusal.split("; use ")[0]  # the builder's advice (another m, another schedule) is no choice mid-run
    return instead, f"schedule {schedule} cannot run on this world of {world_size} ({rule}): this world runs {instead}"


def kept_plan_schedule(schedule: str, plan: Any) -> tuple[str, Optional[str]]:
    """(the schedule that runs `plan`, a plan an admission under a coordinator keeps, the line or None): the one the
    world before ran it with, read from its placement (several stages per rank: the asked one, else the stand-in)."""
    if schedule not in MULTI_STAGE_SCHEDULES or plan.several_stages_per_rank:
        return schedule, None
    instead = STAND_IN[schedule]
    return instead, (f"schedule {schedule}: the plan this world keeps from the one before (the joiner a spare) places "
                     f"one stage per rank: this world runs {instead}")


def fit_schedule(args: Any, config: Any, world_size: int, rank: int) -> tuple[Any, Any]:
    """`args` and `config` for a re-formed world: the stand-in schedule when the asked one cannot run there (one line
    logged on every rank), else the asked one again (a world that grew back). An admission under a coordinator keeps
    the plan the world ran (`args.recovered.plan`), so also the schedule that ran it."""
    asked = getattr(config, "schedule_asked", None) or args.schedule
    kept = getattr(getattr(args, "recovered", None), "plan", None)
    schedule, why = (stand_in(asked, world_size, config.num_microbatches) if kept is None else
                     kept_plan_schedule(asked, kept))
    if why is not None:  # a warning: every rank's log says what its world ran
        logger.warning("[rank %d] %s", rank, why)
    args = argparse.Namespace(**{**vars(args), "schedule": schedule})
    config = dataclasses.replace(config, schedule=schedule, schedule_asked=asked if schedule != asked else None)
    return args, config
