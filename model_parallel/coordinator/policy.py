"""The rebalancing policy (pure, deterministic): measured stage times -> worker speeds -> maybe plan v+1.

Speeds (coordinator/speeds.py). Each active rank's median measured compute ms over a window, less the fixed
overhead every rank spends per step, over the profiled ms of its stages, calibrated so the fastest worker is 1.0
(0.5 = twice slower). The overhead is learned at switches (two plans give each rank two points on its line), so a rank
left with little work after a slowdown is not read as slow for ever.

Decision. The current plan's bottleneck is predicted with those speeds (it equals the measured
bottleneck by construction), the partition is re-solved (for banded speeds: ranks within `noise_band` of each other
at their median, coordinator/robust.py, so one noisy window does not move layers) for the same ranks in the same order
(stage k stays on the k-th rank, so migrations stay small), and plan v+1 is proposed only when
(a) every active rank has a full window of samples under the current plan version, (b) at least
`cooldown_steps` steps passed since the last switch, and (c) the predicted gain
`(current - new) / current` beats `threshold` (hysteresis: a noisy but balanced pipeline never
switches, and a switch is not undone by noise). Before the first switch (plan v0) the cooldown would
count from the start, so a short run could never rebalance: there a predicted gain above twice the
threshold (a plain imbalance) switches at once, and only a marginal one waits for the cooldown.

Change detection. Per-stage measurements cannot tell a slow worker from layers that cost more
than profiled, so every plan changes what the speeds *look* like. Hence speeds are compared with a
`baseline`: the speeds the live plan was solved for, replaced by its first full window when that agrees
(else a worker slowed right after a switch would become the new normal). A switch is considered only when
some worker's relative speed (normalised by the fastest worker) moved by more than `speed_change`
since then — a worker really slowed down or sped up — and stayed so for `persist` evaluations in a
row (a burst of contention on a shared machine passes). The first plan (v0) is the exception: its first
window may re-plan at once, which is how a wrong profile gets corrected (calibration).

Back-off. Measurements on a busy machine are noisy, and per-layer profile errors move with the
layers, so a predicted gain may not materialise. After each switch the coordinator compares the
measured bottleneck under the new plan with the prediction (`delivered`); every switch that did not
deliver at least half its predicted gain counts as a miss, and each miss doubles the effective
threshold (capped at `max_threshold`) and adds one cooldown period; a delivered switch forgives one
miss. A miss also teaches the noise level (what the switch failed to deliver, see coordinator/review.py):
later predicted gains must beat it; a switch made for a change that did not last may be undone at the plain
threshold. No miss is counted when a worker's speed changed since the solve (the prediction was for other
speeds). A detected change skips the cooldown (only misses delay it). So a pipeline that cannot be improved
settles instead of oscillating, while a real 2x straggler (a 30-50% gain) still gets through, within
`window / 2 + persist` steps of when it began, right after a switch included.

Memory. Everything the policy remembers between evaluations (the live plan and when it went live,
misses, baseline, change streak, the pending prediction) is one frozen `PolicyState`:
`decide(state, samples, config) -> (decision, state)` and `switched(state, plan, step, predicted)`
are pure, so the coordinator only stores the state it gets back, and a test replays a run with them.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from model_parallel.coordinator.robust import banded_speeds
from model_parallel.coordinator.review import Review, delivered, judge, speed_change  # noqa: F401 - delivered: API
from model_parallel.coordinator.solver import Solver, default_solver
from model_parallel.coordinator.speeds import (  # noqa: F401 - with_cost_proxy, stage_profiled_ms: the policy's API
    Estimate, Point, active_ranks, calibrated_graph, estimate_speeds, fit_overhead, predicted_bottleneck_ms,
    read_speeds, stage_nodes, stage_profiled_ms, with_cost_proxy)
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan

logger = logging.getLogger(__name__)

# A predicted gain this small is none (float rounding of equal rank sums): even `ctl rebalance` does not switch for it.
NO_GAIN = 1e-9


@dataclass(frozen=True)
class PolicyConfig:
    """`threshold`: minimum predicted relative gain; `cooldown_steps`: steps between switches;
    `window`: samples per rank (median) before speeds are trusted."""

    threshold: float = 0.1
    cooldown_steps: int = 20
    window: int = 5
    max_threshold: float = 0.3
    speed_change: float = 0.5
    persist: int = 3
    # Ranks whose speeds differ by at most this ratio are solved for their group's median (robust.py): one noisy
    # window (a healthy rank 10-15 % slow on a shared machine) must not misplace layers.
    noise_band: float = 0.2

    def __post_init__(self) -> None:
        if not 0 <= self.threshold < 1:
            raise PlanError(f"--threshold must be in [0, 1), got {self.threshold}")
        if self.cooldown_steps < 0:
            raise PlanError(f"--cooldown-steps must be >= 0, got {self.cooldown_steps}")
        if self.window < 1:
            raise PlanError(f"--window must be >= 1, got {self.window}")
        if self.persist < 1:
            raise PlanError(f"persist must be >= 1 evaluation, got {self.persist}")
        if not self.speed_change > 0:
            raise PlanError(f"--speed-change must be > 0, got {self.speed_change}")
        if not 0 <= self.noise_band < 1:
            raise PlanError(f"noise_band must be in [0, 1), got {self.noise_band}")
        if not self.threshold <= self.max_threshold < 1:
            raise PlanError(f"max_threshold must be in [threshold, 1), got {self.max_threshold}")

    def threshold_after(self, misses: int) -> float:
        """Effective threshold after `misses` switches that did not deliver."""
        return min(self.threshold * 2 ** misses, max(self.max_threshold, self.threshold))

    def cooldown_after(self, misses: int) -> int:
        return self.cooldown_steps * (1 + min(misses, 3))


@dataclass(frozen=True)
class Decision:
    """`plan` is the proposed plan v+1, or None with `reason` saying why not. `review`: the live plan's
    switch was judged in this evaluation (once, when its first window was full)."""

    plan: Optional[Plan]
    reason: str
    current_ms: float = 0.0
    predicted_ms: float = 0.0
    estimate: Optional[Estimate] = None
    gain: float = 0.0
    extra: Mapping[str, float] = field(default_factory=dict)
    review: Optional[Review] = None
    solved_for: Optional[Mapping[int, float]] = None  # the speeds `plan` was solved for (`estimate`'s, banded)


@dataclass(frozen=True)
class PolicyState:
    """The policy's memory between evaluations. `decide` and `switched` return a new one, never change it.

    `graph` (cost-proxied, see `with_cost_proxy`) and `solver` are fixed for a run; `plan` is the live
    plan and `version_start_step` the first step run under it."""

    graph: Graph
    plan: Plan
    solver: Optional[Solver] = None
    version_start_step: int = 0
    misses: int = 0  # recent switches that did not deliver (back-off)
    # Speeds in the live plan's first full window (change detection); None at v0 until its first window.
    baseline: Optional[Mapping[int, float]] = None
    learn_baseline: bool = False  # right after a switch: the next full window becomes the baseline
    change_streak: int = 0  # evaluations in a row that saw a speed change beyond `speed_change`
    prediction: Optional[tuple[float, float]] = None  # (current, predicted) ms of the last proposed plan
    review: Optional[tuple[float, float]] = None  # the live plan's switch: (measured before, predicted) ms
    # The speeds the last proposed plan was solved for: once it is live, they are its baseline until its first
    # window agrees with them (a slowdown inside that window must not become the new normal).
    solved_for: Optional[Mapping[int, float]] = None
    # Every rank's last measured speed, spares included (a spare keeps the speed it had when it last ran a stage).
    known_speeds: Mapping[int, float] = field(default_factory=dict)
    # The gain switches failed to deliver (relative to the bottleneck before them): what noise alone can
    # make a re-solve predict. A predicted gain must beat it; a delivered switch halves it.
    noise: float = 0.0
    previous: Optional[Mapping[int, float]] = None  # the baseline before the live plan's switch (review.judge)
    previous_plan: Optional[Plan] = None  # the plan before the live plan's switch
    # After a switch made for a change that did not last: the plan before it, which a re-solve may go back to
    # without beating the noise level (undoing a switch made for noise is not a bet on noise).
    undo: Optional[Plan] = None
    undone: bool = False  # the live plan (or the proposed one, before it is live) is such an undo: it forgives nothing
    overhead_ms: float = 0.0  # the fixed ms per step every rank spends (speeds.py), learned at switches
    overhead_fits: int = 0  # switches that taught it (it is their mean)
    # rank -> (profiled ms, measured ms, its error) in the live plan's latest full window, and in the last one of the
    # plan before the switch: the two points per rank `fit_overhead` fits once the live plan's first window is in.
    points: Optional[Mapping[int, Point]] = None
    points_before: Optional[Mapping[int, Point]] = None


@dataclass(frozen=True)
class Samples:
    """What the policy sees at one evaluation: `step` is now (the furthest step any rank reported) and
    `compute_ms` each rank's compute ms measured under the live plan, past its warm-up steps, oldest first."""

    step: int
    compute_ms: Mapping[int, Sequence[float]]


def decide(state: PolicyState, samples: Samples, config: PolicyConfig,
           force: bool = False) -> tuple[Decision, PolicyState]:
    """Propose plan v+1 or say why not; returns the decision and the policy's next state. Pure: no I/O,
    no clock (the step in `samples` is "now"), the inputs are not changed.

    One evaluation, in order: once the live plan's first window is full, judge the switch that made
    it live (`Decision.review`; a miss raises the threshold and cooldown, see the module docstring),
    then learn its baseline speeds (that evaluation proposes nothing); otherwise `evaluate`.
    `force=True` (ctl rebalance) skips the window-length, cooldown, change and threshold gates but still
    needs one sample per rank, and still returns None when the re-solved plan is the same or predicted no faster
    ("already balanced (predicted gain 0 %)": a switch would pause the workers for nothing).
    """
    ranks = active_ranks(state.plan)
    full = all(len(samples.compute_ms.get(r, ())) >= config.window for r in ranks)
    review = None
    window = window_estimate(state, samples, config) if full else None
    if window is not None and state.learn_baseline and state.points_before is not None:
        state = learned_overhead(state, window)
        window = window_estimate(state, samples, config)
    now = dict(window.speeds) if window is not None else None
    if window is not None:
        state = replace(state, known_speeds={**state.known_speeds, **window.speeds}, points=window.points())
    if state.review is not None and full:
        windows = [list(samples.compute_ms[r])[-config.window:] for r in ranks]
        after = max(sorted(w)[len(w) // 2] for w in windows)
        solved_for = state.baseline if state.learn_baseline else None  # `switched` made it the baseline
        review, misses, noise = judge(state.plan.version, state.review, after, now, solved_for, state.previous,
                                      config.speed_change, state.misses, state.noise)
        if state.undone:  # undoing a switch made for noise delivers by construction: no lesson is forgotten
            misses, noise = state.misses, state.noise
        state = replace(state, review=None, misses=misses, noise=noise,
                        undo=state.previous_plan if review.reverted else None)
    if state.learn_baseline and not force and now is not None:
        # Right after a switch the baseline is what the plan was solved for; its first window replaces it only
        # when it agrees, else a worker that slowed down inside that window would become the new normal.
        if state.baseline is None or speed_change(state.baseline, now) <= config.speed_change:
            reason = f"learned the speeds under plan v{state.plan.version}: " + ", ".join(
                f"rank {r} {v:.2f}" for r, v in sorted(now.items()))
            return Decision(None, reason, review=review), replace(state, baseline=now, learn_baseline=False)
        state = replace(state, learn_baseline=False)  # keep the solved-for speeds: `evaluate` sees the change
    decision = evaluate(state, samples, config, force)
    if not force:
        state = replace(state, change_streak=state.change_streak + 1 if decision.extra.get("changed") else 0)
        if decision.plan is None and state.baseline is None and decision.estimate is not None:
            state = replace(state, baseline=dict(decision.estimate.speeds))  # v0: its first full window
        elif decision.extra.get("settled") and decision.estimate is not None:
            # A change no plan can exploit (no better plan, or a gain under the threshold) is the new normal.
            state = replace(state, baseline=dict(decision.estimate.speeds), change_streak=0)
    if decision.plan is not None:
        state = replace(state, prediction=(decision.current_ms, decision.predicted_ms),
                        solved_for=dict(decision.solved_for) if decision.solved_for else None,
                        undone=bool(decision.extra.get("undo")))
    return replace(decision, review=review), state


def window_estimate(state: PolicyState, samples: Samples, config: PolicyConfig) -> Optional[Estimate]:
    """The live plan's active ranks' speeds over their last full window (None when a rank has no usable sample)."""
    window = {r: list(samples.compute_ms[r])[-config.window:] for r in active_ranks(state.plan)}
    try:
        return estimate_speeds(state.graph, state.plan, window, state.overhead_ms, state.known_speeds)
    except PlanError:
        return None


def learned_overhead(state: PolicyState, window: Estimate) -> PolicyState:
    """The state once the live plan's first full window taught the overhead (speeds.fit_overhead against the last
    window before the switch; the mean of every switch's fit: the overhead is the runtime's, it does not change with
    the speeds). The speeds the plan was solved for are read again with it, so that reading the same times better is
    not taken for a worker whose speed changed."""
    before = state.points_before
    assert before is not None
    fit = fit_overhead(before, window.points())
    state = replace(state, points_before=None)
    if fit is None:
        return state
    fits = state.overhead_fits + 1
    overhead = state.overhead_ms + (fit - state.overhead_ms) / fits
    logger.info("fixed overhead per step: %.3f ms after plan v%d's switch (its fit %.3f ms)", overhead,
                state.plan.version, fit)
    baseline = state.baseline and read_speeds(before, overhead, state.known_speeds)[0]
    return replace(state, overhead_ms=overhead, overhead_fits=fits, baseline=baseline)


def switched(state: PolicyState, plan: Plan, step: int, predicted: bool) -> PolicyState:
    """The state once `plan` went live at `step`. A switch the policy proposed (`predicted`: auto or ctl
    rebalance, not set-plan/scale) is judged against its prediction once the new plan's window is full, and until
    then its baseline is the speeds it was solved for (see `decide`)."""
    baseline = dict(state.solved_for) if predicted and state.solved_for else None
    return replace(state, plan=plan.with_default_ranks(), version_start_step=step, baseline=baseline,
                   points_before=state.points, points=None,
                   previous=state.baseline if predicted else None, previous_plan=state.plan if predicted else None,
                   undo=None, undone=predicted and state.undone, learn_baseline=True, change_streak=0,
                   prediction=None, solved_for=None, review=state.prediction if predicted else None)


def evaluate(state: PolicyState, samples: Samples, config: PolicyConfig, force: bool = False) -> Decision:
    """The decision itself (see the module docstring): gates, speeds, change detection, re-solve, threshold.

    A decision that saw a speed change beyond `speed_change` has `extra["changed"] == 1` (it must persist
    for `persist` evaluations in a row: a burst of contention on a shared machine is not a straggler).
    """
    # A switch that did not deliver taught the noise level: a predicted gain must beat it too.
    threshold, cooldown = max(config.threshold_after(state.misses), state.noise), config.cooldown_after(state.misses)
    graph, solver = state.graph, state.solver or default_solver
    plan = state.plan.with_default_ranks()
    ranks = active_ranks(plan)
    steps_since_switch = samples.step - state.version_start_step
    if not force:
        short = [r for r in ranks if len(samples.compute_ms.get(r, ())) < config.window]
        if short:
            return Decision(None, f"waiting for {config.window} samples from rank(s) {short}")
    # Before the first switch the cooldown counts from the start, which a short run (10 steps) never
    # leaves: a plain imbalance (twice the threshold) may switch at once; a marginal one waits.
    early = not force and plan.version == 0 and steps_since_switch < cooldown
    try:
        estimate = estimate_speeds(graph, plan, {r: list(samples.compute_ms.get(r, ()))[-config.window:] for r in ranks},
                                   state.overhead_ms, state.known_speeds)
    except PlanError as error:
        return Decision(None, str(error))
    changed: dict[str, float] = {}
    if not force and state.baseline is not None:
        change = speed_change(state.baseline, estimate.speeds)
        if change <= config.speed_change:
            return Decision(None, f"speeds steady since plan v{plan.version} went live (largest change {change:.0%})",
                            estimate=estimate)
        changed = {"changed": 1}
        if state.change_streak + 1 < config.persist:
            return Decision(None, f"speed change of {change:.0%} seen {state.change_streak + 1} of {config.persist} "
                                  "times in a row", estimate=estimate, extra=changed)
    if not force and plan.version > 0:
        # A worker whose speed changed is acted on at once (whenever it changed); without such a change (no
        # baseline yet) the cooldown holds. Only the back-off (misses) delays a change.
        wait = config.cooldown_steps * min(state.misses, 3) if changed else cooldown
        if steps_since_switch < wait:
            return Decision(None, f"cooldown: {steps_since_switch} of {wait} steps since the last switch",
                            estimate=estimate, extra=changed)
    current = max(estimate.measured_ms.values())
    banded = banded_speeds(estimate.speeds, config.noise_band)  # one noisy window must not shape the plan
    try:
        candidate = solver(calibrated_graph(graph, estimate.calibration), ranks, [banded[r] for r in ranks])
    except PlanError as error:  # e.g. nothing fits the workers' memory (solver.memory_solver): keep this plan
        return Decision(None, str(error), current, estimate=estimate, extra=changed)
    new = predicted_bottleneck_ms(graph, candidate, banded, estimate.calibration, state.overhead_ms)
    gain = (current - new) / current if current > 0 else 0.0
    same = stage_nodes(candidate) == stage_nodes(plan) and active_ranks(candidate) == ranks
    if same:
        return Decision(None, "the re-solved plan equals the current one", current, new, estimate, gain,
                        {**changed, "settled": 1})
    if force and gain <= NO_GAIN:
        # ctl rebalance: a plan no faster (under a V, a move of the cut between its two middle stages, one rank's)
        # would cost the workers a pause for nothing.
        why = "already balanced (predicted gain 0 %)" if gain >= -NO_GAIN else \
            f"kept plan v{plan.version}: the re-solved plan is predicted {-gain:.1%} slower"
        return Decision(None, why, current, new, estimate, gain, {**changed, "settled": 1})
    if early and gain <= 2 * threshold:
        return Decision(None, f"cooldown: {steps_since_switch} of {cooldown} steps since the start (a first switch "
                              f"before then needs a predicted gain above {2 * threshold:.0%}, got {gain:.1%})",
                        current, new, estimate, gain, changed)
    if state.undo is not None and stage_nodes(candidate) == stage_nodes(state.undo):
        threshold = config.threshold  # back to the plan the switch for noise left: no back-off, no noise bar
        changed = {**changed, "undo": 1}
    if not force and gain <= threshold:
        return Decision(None, f"predicted gain {gain:.1%} does not beat the threshold {threshold:.0%}"
                              + (f" (the noise level learned from a switch that did not deliver)"
                                 if threshold == state.noise > 0 else ""),
                        current, new, estimate, gain, {**changed, "settled": 1})
    # Its times are this machine's (the solver ran on the calibrated graph), not the profile's: say so (ctl status).
    proposed = replace(candidate, version=plan.version + 1,
                       extra={**candidate.extra, "time_scale": "measured", "calibration": round(estimate.calibration, 6)})
    # Both are the slowest rank's compute, not the step (which a schedule's bubble lengthens): a bare "ms per step"
    # read as the step time beside auto's line, which prices the same plan's step higher.
    why = f"predicted {current:.2f} -> {new:.2f} ms per step of the slowest rank's compute ({gain:.1%} gain)" + (
        "; back to the plan before the last switch, which was made for a change that did not last" if "undo" in changed else "")
    return Decision(proposed, why, current, new, estimate, gain, changed, solved_for=banded)
