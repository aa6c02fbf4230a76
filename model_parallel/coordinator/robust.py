"""The speeds a plan is solved for, robust to one noisy window: ranks within the noise band of each other share their median.

One window's median on a shared machine can make a healthy rank look 10-15 % slow (bench/schedules.py's straggler
row once solved for 1.00 / 0.47 / 0.93 / 0.85 and gave the slow rank's neighbours 8 and 6 layers). Such a difference
is below what the policy can tell from noise, so it must not shape the plan: ranks are grouped from the fastest
down, a rank joining the group whose fastest member is at most `band` faster (the ratio of speeds, as
`review.speed_change` measures change), and every member is solved for its group's median speed. A straggler (2x:
a ratio of 1.0) stays outside any group of healthy ranks and keeps its measured speed, so detection is not slowed.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping


def banded_speeds(speeds: Mapping[int, float], band: float) -> dict[int, float]:
    """`speeds` with the ranks within `band` of each other (see the module docstring) at their group's median."""
    if band <= 0 or len(speeds) < 2:
        return dict(speeds)
    groups: list[list[int]] = []
    for rank in sorted(speeds, key=lambda r: -speeds[r]):
        head = speeds[groups[-1][0]] if groups else 0.0
        if groups and speeds[rank] > 0 and head / speeds[rank] - 1.0 <= band:
            groups[-1].append(rank)
        else:
            groups.append([rank])
    out: dict[int, float] = {}
    for group in groups:
        median = statistics.median(speeds[r] for r in group)
        out.update({r: median for r in group})
    # Not rescaled to 1.0: the calibration came from the fastest rank, whose window may be the noisy one; the
    # group's median is the better guess of what its ranks run at, so the predicted gain stays honest.
    return out
