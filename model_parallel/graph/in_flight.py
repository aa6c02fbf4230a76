"""The schedules' names and how many microbatches a stage holds in flight: one rule, shared below everyone.

The runtime's schedules (runtime/step/schedule.py: their grids and the bound `check` enforces), the
optimizer's memory model (optimizer/memory.py: activations and stashed weights a stage holds) and the
command lines' `--schedule` choices all read them here, so a prediction and a run never disagree on it.

For a stage after `ranks_before` of the pipeline's `num_ranks` ranks, on `replicas` replicas that are
dealt the microbatches round-robin, with m microbatches per minibatch:

    gpipe      ceil(m / r)                                all forwards run before any backward
    1f1b       min(ceil((M - before) / r), ceil(m / r))   warm-up forwards, then one forward per backward
    pipedream  ceil((M - before) / r)                     1F1B with no flush: the stream never drains

With one rank per stage, stage s of p holds p - s (1F1B capped by m) — the grids' bound.
"""
from __future__ import annotations

import math

SCHEDULE_NAMES = ("1f1b", "gpipe", "pipedream")  # the first is the default everywhere
FLUSH_SCHEDULES = ("1f1b", "gpipe")  # one optimizer step per minibatch, after every backward of it


def microbatches_in_flight(schedule: str, num_microbatches: int, num_ranks: int, ranks_before: int,
                           replicas: int = 1) -> int:
    """Microbatches whose saved activations one replica of the stage holds at its peak (see the table above)."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if schedule == "gpipe":
        return math.ceil(num_microbatches / replicas)
    downstream = math.ceil((num_ranks - ranks_before) / replicas)
    if schedule == "pipedream":
        return downstream
    return min(downstream, math.ceil(num_microbatches / replicas))
