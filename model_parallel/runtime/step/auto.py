"""`--schedule auto`: simulate every flush schedule that can run on its candidate plan and pick the fastest.

Each candidate is a schedule name with the per-stage times of the plan it would run (Interleaved 1F1B
cuts the model into more stages than ranks, so its plan and times differ) or the reason it cannot run
(memory, the plan, the config). The grid comes from the runtime's own builders (`run_schedule`), its
time from the simulator (optimizer/simulate.py); the lowest predicted step wins, unless an earlier
candidate in `FLUSH_SCHEDULES` order is within `TIE` of it (1f1b before gpipe: about the same time
for less memory; the model is not exact to a percent). Pure
and deterministic: every rank that builds the same job reaches the same choice. The one line it logs:

    schedule auto: chose 1f1b (predicted 123.4 ms/step, bubble 31 %; gpipe 140.2 ms, interleaved refused: ...)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from model_parallel.errors import ScheduleError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import FLUSH_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from model_parallel.graph.plan import Plan, plan_stage_times
from model_parallel.optimizer.simulate import StageTimes
from model_parallel.runtime.step.interleaved import run_schedule
from model_parallel.runtime.step.list_order import LIST, simulate_schedule, timed_schedule  # noqa: F401  (re-exported)

AUTO = "auto"
TIE = 0.01  # a candidate must predict a step this much shorter than an earlier one to be chosen over it
EXTRA_KEY = "schedule"  # plan.extra[EXTRA_KEY]: the choice, carried with the plan (its table prints it)


@dataclass(frozen=True)
class Candidate:
    """A schedule auto may pick: its plan's per-stage times (per microbatch) and edge transfers, or why it cannot run."""

    name: str
    times: tuple[StageTimes, ...] = ()
    transfer_ms: Union[float, tuple[float, ...]] = 0.0
    refused: Optional[str] = None
    list_order: bool = False  # priced in the order the run list-builds from `times` (list_order.py), not the fixed one


@dataclass(frozen=True)
class Prediction:
    """One simulated candidate: the step's makespan, each rank's bubble and its order ("list"-built or "fixed")."""

    name: str
    step_ms: float
    bubbles: tuple[float, ...]
    order: str = "fixed"

    @property
    def bubble(self) -> float:
        return sum(self.bubbles) / len(self.bubbles) if self.bubbles else 0.0


@dataclass(frozen=True)
class Choice:
    """What auto chose, what it predicted for every candidate it simulated, and why the others were refused."""

    name: str
    predictions: tuple[Prediction, ...]
    refused: tuple[tuple[str, str], ...]
    unit: str = "ms"  # "ms", or "units" where the times are a proxy (an untimed graph: parameter bytes)

    @property
    def chosen(self) -> Prediction:
        return next(p for p in self.predictions if p.name == self.name)

    def line(self, when: str = "") -> str:
        """The one line it logs; `when` (" after plan v3") says which plan a re-choice was made for."""
        chosen, per = self.chosen, "ms/step" if self.unit == "ms" else f"{self.unit}/step"
        others = [f"{p.name} {p.step_ms:.1f} {self.unit}" for p in self.predictions if p.name != self.name]
        others += [f"{name} refused: {why}" for name, why in self.refused]
        rest = f"; {', '.join(others)}" if others else ""
        order = "list-built order, " if chosen.order == LIST else ""
        return (f"schedule auto{when}: chose {self.name} ({order}predicted {chosen.step_ms:.1f} {per}, bubble "
                f"{100 * chosen.bubble:.0f} %{rest})")

    def to_extra(self, when: str = "") -> dict[str, Any]:
        """What the plan carries (`plan.extra["schedule"]`): plain JSON, the same on every rank."""
        chosen = self.chosen
        return {"name": self.name, "chosen_by": AUTO, "predicted_step": round(chosen.step_ms, 6), "unit": self.unit,
                "predicted_bubble": round(chosen.bubble, 6), "order": chosen.order, "line": self.line(when)}


def stage_times(graph: Graph, plan: Plan, scale: float) -> tuple[StageTimes, ...]:
    """Per stage of `plan`: forward and backward ms of one microbatch (`scale` = microbatch / profiled batch),
    a replicated stage's divided by its replicas (they take the microbatches in turn). The backward's split
    into input and weight gradients (I/W schedules) is estimated, not profiled: a node with parameters spends
    half its backward on each (dX and dW of a matmul or a convolution cost the same), a node without any
    spends all of it on I."""
    stage_of = plan.stage_of
    forward, backward, weight = [0.0] * plan.num_stages, [0.0] * plan.num_stages, [0.0] * plan.num_stages
    for node in graph.nodes:
        forward[stage_of[node.node_id]] += node.forward_ms
        backward[stage_of[node.node_id]] += node.backward_ms
        if node.parameter_size > 0:
            weight[stage_of[node.node_id]] += node.backward_ms / 2
    times = []
    for s in plan.stages:
        share = scale / s.num_replicas
        b, w = backward[s.stage_id] * share, weight[s.stage_id] * share
        times.append(StageTimes(forward[s.stage_id] * share, b, b - w, w))
    return tuple(times)


def proxy_times(times: Sequence[StageTimes]) -> tuple[StageTimes, ...]:
    """Times for a graph without timings: its proxy (parameter bytes) prices a stage's forward only; a backward
    costs about twice its forward, half of it input and half weight gradient."""
    return tuple(StageTimes(t.forward_ms, 2 * t.forward_ms, t.forward_ms, t.forward_ms) for t in times)


def given_times(plan: Plan) -> Optional[tuple[StageTimes, ...]]:
    """The plan's `stage_times` (checked by graph/plan.py) as StageTimes, or None where it carries none."""
    given = plan_stage_times(plan)
    return None if given is None else tuple(StageTimes(f, i + w, i, w) for f, i, w in given)


def order_times(graph: Graph, plan: Plan, micro_batch: int) -> Optional[tuple[StageTimes, ...]]:
    """The per-stage times a run list-builds its zero-bubble order from (list_order.py), the same on every rank: the
    plan's `stage_times` (the coordinator's measured ones; graph/plan.py checks them), else the profile's as auto
    prices them (`stage_times`, one microbatch of `micro_batch` samples); None for a graph without timings (a proxy
    is no ground to reorder on: the fixed order runs)."""
    from model_parallel.optimizer.memory import activation_scale

    given = given_times(plan)
    if given is not None:
        return given
    if not any(node.compute_ms > 0 for node in graph.nodes):
        return None
    return stage_times(graph, plan, activation_scale(graph, micro_batch))


def run_order_times(graph: Graph, plan: Plan, config: Any) -> Optional[tuple[StageTimes, ...]]:
    """`order_times` for a run of `config` (a TrainConfig), or None where it runs the fixed order (`schedule_order`
    "fixed", or a schedule without the I/W split). The engine builds its schedule with it and compares it across
    ranks (wire/agreement.check_same_job): ranks with other times would build other orders."""
    if config.schedule_order != LIST or config.schedule not in ZERO_BUBBLE_SCHEDULES:
        return None
    return order_times(graph, plan, max(1, config.batch_size // config.num_microbatches))


def predict(candidate: Candidate, num_microbatches: int, num_ranks: int) -> Prediction:
    """The candidate's schedule over its plan's stages on `num_ranks` ranks, in the order the run will use, simulated."""
    schedule = run_schedule(candidate.name, len(candidate.times), num_microbatches, num_ranks)
    if candidate.list_order:
        schedule = timed_schedule(schedule, candidate.times)
    result = simulate_schedule(schedule, candidate.times, candidate.transfer_ms)
    return Prediction(candidate.name, result.makespan_ms, result.bubbles, schedule.order)


def choose_schedule(candidates: Sequence[Candidate], num_microbatches: int, num_ranks: int,
                    unit: str = "ms") -> Choice:
    """The fastest candidate that is not refused (within `TIE`: the earlier in FLUSH_SCHEDULES order); raises
    ScheduleError naming every candidate's reason when none can run."""
    order = {name: index for index, name in enumerate(FLUSH_SCHEDULES)}
    unknown = [c.name for c in candidates if c.name not in order]
    if unknown:
        raise ScheduleError(f"schedule auto chooses among the flush schedules {', '.join(FLUSH_SCHEDULES)}; got {unknown}")
    ranked = sorted(candidates, key=lambda c: order[c.name])
    refused = [(c.name, c.refused) for c in ranked if c.refused is not None]
    predictions = []
    for candidate in (c for c in ranked if c.refused is None):
        try:
            predictions.append(predict(candidate, num_microbatches, num_ranks))
        except ScheduleError as error:  # e.g. an I/W-split schedule without the split times, m that does not fit it
            refused.append((candidate.name, f"cannot be simulated: {str(error).splitlines()[0]}"))
    if not predictions:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused) or "no candidates"
        raise ScheduleError(f"schedule auto: no schedule can run this job ({reasons})")
    best = predictions[0]
    for prediction in predictions[1:]:  # clearly faster only: a near tie keeps the earlier (less memory)
        if prediction.step_ms < best.step_ms * (1 - TIE):
            best = prediction
    return Choice(best.name, tuple(predictions), tuple(refused), unit)


def chosen_schedule(plan: Any) -> str:
    """The schedule auto chose for `plan` (the job builder put it in `plan.extra`); ScheduleError without one."""
    choice = dict(getattr(plan, "extra", {}) or {}).get(EXTRA_KEY)
    name = choice.get("name") if isinstance(choice, dict) else None
    if name not in FLUSH_SCHEDULES:
        raise ScheduleError(f"schedule 'auto' is resolved by the job builder (api.job.build_job with schedule='auto'), "
                            f"which records its choice in plan.extra[{EXTRA_KEY!r}]; this plan has {choice!r}: build the "
                            "job with schedule='auto', or name a schedule")
    return str(name)
