"""Judging a plan switch once the new plan ran a full window: delivered, a miss (noise), or not judged.

A switch is proposed for speeds measured over one window. When the new plan's first window is full,
three things can have happened (speeds compared with `speed_change`, normalised by the fastest worker):

- the speeds are the ones it was solved for: the prediction is judged (`delivered`: at least half
  the predicted gain); a shortfall is what noise made the solver promise, and becomes the noise level;
- the speeds went back to what they were before the change the switch was made for: that change did
  not last (contention, a burst), so the switch was made for noise: a miss, and its whole predicted
  gain becomes the noise level (a change of that size is not worth a switch);
- the speeds moved somewhere new (a worker slowed right after the switch): the prediction was for
  other speeds, so nothing is learned and the change is re-planned for (`judged` is False).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional


def delivered(before_ms: float, predicted_ms: float, after_ms: float) -> bool:
    """Did a switch deliver at least half of the gain it predicted? (measured bottleneck before/after)"""
    if before_ms <= 0:
        return True
    predicted_gain = (before_ms - predicted_ms) / before_ms
    return (before_ms - after_ms) / before_ms >= 0.5 * predicted_gain


def speed_change(baseline: Mapping[int, float], speeds: Mapping[int, float]) -> float:
    """Largest relative change of a worker's speed (each normalised by the fastest worker) since `baseline`.

    A rank missing from the baseline counts as a full change (1.0). (Not by the median worker: when half the
    workers slow down the median moves with them and hides half of their change.)
    """
    def normalised(values: Mapping[int, float]) -> dict[int, float]:
        top = max(values.values()) if values else 1.0
        return {r: v / top for r, v in values.items()} if top > 0 else dict(values)

    before, now = normalised(baseline), normalised(speeds)
    worst = 0.0
    for rank, value in now.items():
        if rank not in before or before[rank] <= 0 or value <= 0:
            return 1.0
        worst = max(worst, max(value / before[rank], before[rank] / value) - 1.0)
    return worst


@dataclass(frozen=True)
class Review:
    """How the switch to plan `version` did: measured bottleneck before it, its prediction, measured after (ms).

    `judged` False: a worker's speed changed since the plan was solved, so nothing was learned. `reverted`: the
    speeds went back to those before the change the switch was made for (a miss: the change was noise)."""

    version: int
    before_ms: float
    predicted_ms: float
    after_ms: float
    delivered: bool
    judged: bool = True
    reverted: bool = False


def judge(version: int, prediction: tuple[float, float], after_ms: float, now: Optional[Mapping[int, float]],
          solved_for: Optional[Mapping[int, float]], previous: Optional[Mapping[int, float]], limit: float,
          misses: int, noise: float) -> tuple[Review, int, float]:
    """The review of a switch and the policy's next (misses, noise level); see the module docstring.

    `solved_for`: the speeds the plan was solved for; `previous`: the baseline before the change it was made
    for; `limit`: the `speed_change` beyond which speeds differ."""
    before, predicted = prediction
    ok = delivered(before, predicted, after_ms)
    moved = now is not None and solved_for is not None and speed_change(solved_for, now) > limit
    if moved:
        if previous is not None and speed_change(previous, now) <= limit:  # the change did not last
            gain = (before - predicted) / before if before > 0 else 0.0
            return (Review(version, before, predicted, after_ms, False, True, True), misses + 1,
                    max(noise, min(gain, 1.0)))
        return Review(version, before, predicted, after_ms, ok, False), misses, noise
    review = Review(version, before, predicted, after_ms, ok)
    if ok:
        return review, max(0, misses - 1), noise / 2
    shortfall = max(0.0, (after_ms - predicted) / before) if before > 0 else 0.0
    return review, misses + 1, max(noise, min(shortfall, 1.0))
