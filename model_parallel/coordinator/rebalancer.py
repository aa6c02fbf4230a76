"""Plan switches on the coordinator: when the policy runs, sending plan v+1 to rank 0, confirming it, the log.

The policy (`policy.decide`) is pure; `Rebalancer` keeps the `PolicyState` it returns and what the
coordinator tells about switches (`history`, `decisions`). Every method runs with the coordinator's
lock held; `send(rank, command)` is the server's transport: it returns the connection the command went out on.

A switch's life: a decision (auto, ctl rebalance) or a ctl set-plan/scale gives plan v+1; `issue`
sends `command {switch}` to rank 0, whose runtime broadcasts it to every rank at its next step
boundary, and keeps it `pending`; the first report carrying the new version confirms it (it is live
from that step), a `switch-refused` or `switch-failed` from rank 0 forgets it. Rank 0 answers every
switch it receives, so one is lost only with the connection it went out on: when that connection ends
before an answer (or, a safety net, no answer comes within PENDING_TIMEOUT_S) it is given up on
(`dropped`: a new plan may be issued). Rank 0 may have received it all the same and applies it (the
command waits in its channel while it reconnects): a report of its version then confirms it late, even
when a newer plan was sent meanwhile (that one stays pending). Steps are never the clock here: under
load the reports lag rank 0 by tens of steps, and a switch judged lost by a step count was not.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from model_parallel.coordinator import policy
from model_parallel.coordinator.status import WorkerState, plan_times_label
from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, StepReport

logger = logging.getLogger(__name__)

WARMUP_STEPS = 1  # samples from the first step(s) under a plan include warm-up/migration noise
# No answer from rank 0 this long after a switch went out on a connection still open: a bug, not a loss (rank 0 answers
# every switch); given up on so rebalancing goes on. Generous: applying a switch moves layers, seconds on big models.
PENDING_TIMEOUT_S = 120.0
DECISION_LOG = 100
# Plan switches kept in the history (ctl status, the status file); a run that switches every few hundred steps for days
# grew it by ~280 bytes a switch until `ctl status` no longer fit a frame (protocol.MAX_FRAME_BYTES). `switches` counts all.
HISTORY_LOG = 100

# send(rank, command) -> the connection it went out on (any object, compared by identity when a connection ends:
# `connection_ended`), or None when it could not be sent.
Send = Callable[[int, Command], Optional[object]]


@dataclass(frozen=True)
class PendingSwitch:
    plan: Plan  # plan v+1, sent to rank 0
    predicted: bool  # proposed by the policy: judged against its prediction once live
    schedule: Optional[str] = None  # the schedule it runs (None: the coordinator does not know the workers')
    link: Optional[object] = None  # the connection to rank 0 it went out on (what `send` returned)
    sent_at: float = 0.0  # Rebalancer.clock() when it went out


class Rebalancer:
    """The live plan, the policy's memory and the switch in flight; see the module docstring."""

    def __init__(self, graph: Graph, plan: Plan, config: policy.PolicyConfig, solver: Optional[policy.Solver],
                 auto: bool, world_size: int, schedule: Optional[str] = None, memory: Any = None) -> None:
        self.state = policy.PolicyState(graph, plan.with_default_ranks(), solver)
        self.config = config
        self.auto = auto
        self.world_size, self.schedule = world_size, schedule  # what a plan is checked against before it is issued
        self.memory = memory  # optimizer.memory.MemoryLimit under --memory_per_worker: no plan issued past it
        # `--schedule auto` on the workers (they say so when they register, with their microbatches): each plan
        # issued runs the schedule chosen again for it (rechoose.py), named in the switch command.
        self.schedule_auto = False
        self.num_microbatches: Optional[int] = None
        self.list_order = True  # the workers list-build zero bubble's order (their --schedule_order; list_order.py)
        self.calibration = 1.0  # measured / profiled ms on a nominal rank, from the latest estimate (rechoose.py)
        self.pending: Optional[PendingSwitch] = None
        # A pending switch given up on (its connection ended, or no answer in PENDING_TIMEOUT_S): rank 0 may still
        # apply it (it waits in rank 0's channel); a report of its version then confirms it after all.
        self.dropped: Optional[PendingSwitch] = None
        self.history: list[dict[str, Any]] = []  # the last HISTORY_LOG plan switches: version, step, reason (+ review)
        self.switches = 0  # history entries ever recorded (issued, adopted), the trimmed ones included
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISION_LOG)  # policy outcomes whenever the reason changes
        self.last_decision = "no decision yet"
        self.last_eval_step = -1
        self._mismatch_warned = False
        # The newest plan version any worker reported: a fresh coordinator facing workers that already
        # switched numbers its plans above it (workers refuse a switch to a version they run or passed).
        self.highest_reported = 0
        self.highest_issued = 0  # a refused plan's version is spent too: the workers' channels saw it
        self.clock: Callable[[], float] = time.monotonic  # PENDING_TIMEOUT_S's clock (a test may script it)

    @property
    def plan(self) -> Plan:
        return self.state.plan

    @property
    def graph(self) -> Graph:
        return self.state.graph

    def samples(self, workers: Mapping[int, WorkerState], step: int) -> policy.Samples:
        """Each rank's compute ms measured under the live plan, past its warm-up steps."""
        first = self.state.version_start_step + WARMUP_STEPS
        version = self.plan.version
        return policy.Samples(step, {rank: [r.compute_ms for r in w.reports if r.plan_version == version and r.step >= first]
                                     for rank, w in workers.items()})

    def on_report(self, worker: WorkerState, report: StepReport, workers: Mapping[int, WorkerState], send: Send,
                  stopping: bool) -> None:
        """A checked report was recorded: confirm or forget the pending switch, maybe run the policy."""
        self.highest_reported = max(self.highest_reported, report.plan_version)
        held = self.plan.stages_of_rank(worker.rank)  # several in a loop or a V: a report names the first
        expected = held[0] if held else None
        if report.plan_version == self.plan.version and report.stage != expected and not self._mismatch_warned:
            self._mismatch_warned = True
            logger.error("rank %d runs stage %s but plan v%d puts it on stage %s: start the workers with the "
                         "coordinator's --plan (rebalancing decisions would be wrong)", worker.rank, report.stage,
                         self.plan.version, expected)
        if self.dropped is not None and report.plan_version == self.dropped.plan.version:
            late, newer = self.dropped, self.pending
            logger.warning("plan v%d was applied after all (rank %d reports it at step %d)%s", report.plan_version,
                           worker.rank, report.step, "" if newer is None else
                           f"; plan v{newer.plan.version}, sent since, stays pending")
            self.remember_speeds(workers)
            self.pending, self.dropped = late, None
            self.confirm(report.step)
            self.pending = newer
        if self.pending is not None and report.plan_version >= self.pending.plan.version:
            self.remember_speeds(workers)  # the old plan's last window: a rank it leaves as a spare keeps its speed
            self.confirm(report.step)
        elif self.pending is not None and worker.rank == 0 and self.clock() - self.pending.sent_at > PENDING_TIMEOUT_S:
            self._give_up(f"no answer from rank 0 within {PENDING_TIMEOUT_S:.0f} s (it is at step {report.step})")
        if not self.auto or self.pending is not None or stopping:
            return  # (every schedule is re-planned: one stage per rank, a loop or a V, coordinator/solver.py)
        step = max(w.step for w in workers.values())
        # Evaluate at most once per step; after a solve that found nothing worth it, wait a window
        # (solving can take a while on big graphs; the gates before it are cheap).
        if step <= self.last_eval_step:
            return
        try:
            decision = self.decide(workers, step, force=False)
        except Exception:  # noqa: BLE001 - a policy bug must not cut this worker's connection
            logger.exception("the policy failed at step %d; no rebalancing this time", step)
            self.last_eval_step = step + self.config.window - 1
            return
        solved = decision.plan is None and decision.current_ms > 0
        self.last_eval_step = step + self.config.window - 1 if solved else step
        if decision.plan is not None:
            try:
                self.issue(decision.plan, f"auto: {decision.reason}", step, send, predicted=True,
                           speeds=decision.solved_for)  # the speeds it was solved for (banded, robust.py)
            except PlanError as error:  # a solver plan the workers would refuse: a bug, not a reason to stop
                logger.error("the policy's plan at step %d fails the workers' checks, not issued: %s", step, error)
                self.last_eval_step = step + self.config.window - 1
            except InfeasibleError as error:  # over --memory_per_worker, e.g. only while switching: keep the live plan
                logger.warning("the policy's plan at step %d is not issued: %s", step, error)
                self.last_eval_step = step + self.config.window - 1

    def decide(self, workers: Mapping[int, WorkerState], step: int, force: bool) -> policy.Decision:
        """Run the policy on the live plan's samples and keep the state it returns."""
        decision, self.state = policy.decide(self.state, self.samples(workers, step), self.config, force)
        if decision.estimate is not None:
            self.calibration = decision.estimate.calibration
        if decision.review is not None:
            self._note_review(decision.review)
        if decision.reason != self.last_decision:
            self.decisions.append({"step": step, "plan_version": self.plan.version, "reason": decision.reason})
        self.last_decision = decision.reason
        logger.debug("policy at step %d: %s", step, decision.reason)
        return decision

    def _note_review(self, review: policy.Review) -> None:
        entry = next((h for h in self.history if h["version"] == review.version), None)
        if entry is not None:
            entry.update(measured_before_ms=round(review.before_ms, 3), predicted_ms=round(review.predicted_ms, 3),
                         measured_after_ms=round(review.after_ms, 3),
                         delivered=review.delivered if review.judged else "not judged (a worker's speed changed)")
        if not review.judged:
            logger.warning("plan v%d: bottleneck %.2f -> %.2f ms (predicted %.2f) not judged: a worker's speed changed "
                           "since the plan was solved (re-planning for the new speeds)", review.version,
                           review.before_ms, review.after_ms, review.predicted_ms)
            return
        misses = self.state.misses
        log = logger.info if review.delivered else logger.warning
        log("plan v%d: bottleneck %.2f -> %.2f ms (predicted %.2f)%s", review.version, review.before_ms, review.after_ms,
            review.predicted_ms, "" if review.delivered else
            f"; gain not delivered, backing off (threshold now {self.config.threshold_after(misses):.0%}, "
            f"cooldown {self.config.cooldown_after(misses)} steps, noise level {self.state.noise:.0%})")

    def issue(self, plan: Plan, reason: str, step: int, send: Send, predicted: bool,
              speeds: Optional[Mapping[int, float]] = None) -> Optional[Plan]:
        """Check `plan` as the workers will (PlanError: not issued), send it as v+1 to rank 0; returns it, or
        None when rank 0 is away (nothing will apply it). Under `--schedule auto` its schedule is chosen again
        from `speeds` (each rank's measured speed; default: the last known) and sent with it."""
        from model_parallel.runtime.plancheck import check_plan, check_switchable  # the workers' own rules

        check_switchable(self.schedule)  # a PlanError: refused to the operator (ctl) before anything is sent
        version = max(self.plan.version, self.highest_reported, self.highest_issued) + 1
        plan, schedule = replace(plan, version=version), self.schedule
        if self.num_microbatches is not None:  # what the workers list-build zero bubble's order from (list_order.py)
            plan = self._with_stage_times(plan.with_default_ranks(), speeds)
        chosen = self.schedule_auto and self.num_microbatches is not None
        if chosen:
            plan, schedule = self._rechoose(plan.with_default_ranks(), speeds)
        plan = check_plan(self.graph, plan, self.world_size, schedule).plan
        if self.memory is not None:
            # Auto's choice is priced by its own footprint; a fixed schedule by the coordinator's (its served flags)
            memory = replace(self.memory, footprint=replace(self.memory.footprint, schedule=schedule)) \
                if chosen and schedule is not None else self.memory
            memory.check(self.graph, plan, f"plan v{version}")
            memory.check_switch(self.graph, self.plan, plan, f"the switch to plan v{version}")
        self._record({"version": plan.version, "requested_at_step": step, "reason": reason,
                      **({"schedule": schedule} if chosen else {})})
        logger.warning("requesting plan v%d after step %d: %s\n%s\n%s", plan.version, step, reason,
                       plan_times_label(dict(plan.extra)), plan.table())
        link = send(0, Command.switch(plan, reason=reason, schedule=schedule if chosen else None))
        if link is None:
            return None  # asked again once rank 0 is back (the next evaluation or ctl request)
        self.highest_issued = plan.version
        self.pending = PendingSwitch(plan, predicted, schedule, link, self.clock())
        return plan

    def connection_ended(self, link: object) -> None:
        """A connection to a worker ended (`link`: what `send` returned for it). A switch that went out on it and
        has no answer may never have arrived: given up on, so a new plan may be issued (a late report confirms it)."""
        if self.pending is not None and self.pending.link is link:
            self._give_up("the connection to rank 0 it went out on ended before rank 0 answered")

    def _give_up(self, why: str) -> None:
        assert self.pending is not None
        logger.warning("plan v%d was not confirmed: %s; giving up on it (a report of it still confirms it)",
                       self.pending.plan.version, why)
        self.pending, self.dropped = None, self.pending

    def _known_speeds(self, speeds: Optional[Mapping[int, float]]) -> dict[int, float]:
        return {**self.state.known_speeds, **(speeds or {})}  # a spare keeps its last measured speed

    def _with_stage_times(self, plan: Plan, speeds: Optional[Mapping[int, float]]) -> Plan:
        """`plan` carrying the per-stage [F, I, W] ms the coordinator measured for it (rechoose.measured_times), as
        `plan.extra["stage_times"]`: the workers build their zero-bubble order for the real speeds."""
        from model_parallel.coordinator.rechoose import measured_times
        from model_parallel.graph.plan import with_stage_times

        assert self.num_microbatches is not None
        return with_stage_times(plan, measured_times(self.graph, plan, self._known_speeds(speeds), self.calibration,
                                                     self.num_microbatches))

    def _rechoose(self, plan: Plan, speeds: Optional[Mapping[int, float]]) -> tuple[Plan, str]:
        """`plan` carrying the schedule `--schedule auto` chooses for it now (rechoose.py), and that schedule; logs
        the choice's line. PlanError (InfeasibleError: over the memory limit) when no schedule can run it."""
        from model_parallel.coordinator.rechoose import TIMES_NOTE, rechoose
        from model_parallel.runtime.step.auto import EXTRA_KEY

        assert self.num_microbatches is not None
        choice = rechoose(self.graph, plan, self.world_size, self._known_speeds(speeds), self.calibration, self.num_microbatches,
                          self.memory, self.list_order)
        when = f" after plan v{plan.version}"
        logger.warning("%s [%s]", choice.line(when), TIMES_NOTE)
        return replace(plan, extra={**dict(plan.extra), EXTRA_KEY: choice.to_extra(when)}), choice.name

    def adopt(self, plan: Plan, step: int, world_size: int, reason: str) -> None:
        """Make `plan`, which the workers already run from `step`, the live plan (membership.py: a re-formed world, or
        the live plan learned by a coordinator started again): a new policy memory, speeds measured afresh. A switch
        still pending or given up on (the world failed in it, or before applying it) is abandoned: recorded so in the
        history (a given-up one too: rank 0's connection ends when the world re-forms, before this runs)."""
        for unconfirmed in (self.dropped, self.pending):
            if unconfirmed is None:
                continue
            for entry in self.history:
                if entry["version"] == unconfirmed.plan.version and "applied_at_step" not in entry:
                    entry["abandoned"] = reason
            logger.warning("plan v%d was never confirmed live; abandoned for plan v%d (%s)", unconfirmed.plan.version,
                           plan.version, reason)
        # The fixed overhead per step is the runtime's, not the world's: it is kept.
        self.state = policy.PolicyState(self.state.graph, plan.with_default_ranks(), self.state.solver,
                                        version_start_step=step, overhead_ms=self.state.overhead_ms,
                                        overhead_fits=self.state.overhead_fits)
        self.world_size, self.pending, self.dropped, self.last_eval_step = world_size, None, None, step
        self.highest_reported = max(self.highest_reported, plan.version)
        self._mismatch_warned = False
        self._record({"version": plan.version, "requested_at_step": step, "applied_at_step": step, "reason": reason})

    def _record(self, entry: dict[str, Any]) -> None:
        """A plan switch into the history, which keeps the last HISTORY_LOG (a pending one is always among them)."""
        self.history.append(entry)
        del self.history[:-HISTORY_LOG]
        self.switches += 1

    def confirm(self, step: int) -> None:
        assert self.pending is not None
        pending, self.pending = self.pending, None
        self.state = policy.switched(self.state, pending.plan, step, pending.predicted)
        self.last_eval_step = step
        self.schedule = pending.schedule or self.schedule  # the workers run it from this step
        if self.dropped is not None and self.dropped.plan.version < self.plan.version:
            self.dropped = None  # rank 0 went past it: it never arrives now
        for entry in self.history:
            if entry["version"] == self.plan.version:
                entry["applied_at_step"] = step
        logger.warning("plan v%d is live from step %d", self.plan.version, step)

    def failed(self, rank: int, version: int, reason: str) -> None:
        """Rank 0 says the switch to plan `version` failed on `rank` after it started and every rank rolled back
        to the live plan (`reason`: each failed rank and its one-line cause): forget it, the job goes on."""
        for entry in self.history:
            if entry["version"] == version:
                entry["rolled_back"] = reason
        if self.pending is not None and self.pending.plan.version == version:
            self.pending = None
        if self.dropped is not None and self.dropped.plan.version == version:
            self.dropped = None
        logger.error("plan v%d failed on rank %d after the switch started (%s); every rank rolled back, the job goes "
                     "on with plan v%d", version, rank, reason, self.plan.version)

    def refused(self, rank: int, version: int, reason: str) -> None:
        """Rank `rank` says every rank refused the switch to plan `version` before moving anything: forget it."""
        for entry in self.history:
            if entry["version"] == version:
                entry["refused"] = reason
        if self.pending is not None and self.pending.plan.version == version:
            self.pending = None
        if self.dropped is not None and self.dropped.plan.version == version:
            self.dropped = None
        logger.error("rank %d refused plan v%d: %s; the job goes on with plan v%d", rank, version, reason, self.plan.version)

    def speeds(self, workers: Mapping[int, WorkerState]) -> dict[int, float]:
        """Latest speed estimate per rank: measured under the live plan, else the last one measured (a spare
        keeps the speed it had when it last held a stage); ranks never measured are absent."""
        window = self.config.window
        samples = {r: list(v)[-window:] for r, v in self.samples(workers, 0).compute_ms.items() if v}
        try:
            estimate = policy.estimate_speeds(self.graph, self.plan, samples, self.state.overhead_ms, self.state.known_speeds)
            live, self.calibration = dict(estimate.speeds), estimate.calibration
        except PlanError:
            live = {}
        return {**self.state.known_speeds, **live}

    def slowed(self, rank: int, old_factor: float, new_factor: float) -> None:
        """`ctl slow` changed rank's slowdown: its remembered speed (used while it is a spare) changes by the same
        factor; the live estimate will measure it anyway once it holds a stage."""
        known = self.state.known_speeds
        if rank in known and new_factor > 0:
            self.state = replace(self.state, known_speeds={**known, rank: known[rank] * old_factor / new_factor})

    def remember_speeds(self, workers: Mapping[int, WorkerState]) -> None:
        """Keep the live plan's speeds in the policy's memory (the auto policy does it itself; ctl scale and
        set-plan under --policy manual need it too)."""
        self.state = replace(self.state, known_speeds=self.speeds(workers))

    def summary(self, workers: Mapping[int, WorkerState]) -> dict[str, Any]:
        """The plan part of the status: live and pending plan, per-stage times, policy outcomes, history."""
        samples = self.samples(workers, 0).compute_ms
        speeds = self.speeds(workers)
        stages = []
        held = Counter(rank for stage in self.plan.stages for rank in stage.ranks)
        for stage in self.plan.stages:
            for rank in stage.ranks:
                values = list(samples.get(rank, []))[-self.config.window:]
                stages.append({
                    # Workers measure per rank: under loop or V placement a stage's row carries its rank's total.
                    "measured_is_rank_total": held[rank] > 1,
                    "stage": stage.stage_id, "rank": rank, "num_nodes": len(stage.node_ids),
                    "profiled_ms": policy.stage_profiled_ms(self.graph, stage) / stage.num_replicas,
                    "measured_ms": (sorted(values)[len(values) // 2] if values else None),
                    "speed": speeds.get(rank),
                })
        return {
            "plan_version": self.plan.version,
            "plan": self.plan.to_dict(),
            "table": self.plan.table(),
            "pending_version": self.pending.plan.version if self.pending else None,
            "last_decision": self.last_decision,
            "misses": self.state.misses,
            "effective_threshold": max(self.config.threshold_after(self.state.misses), self.state.noise),
            "noise_level": self.state.noise,
            "overhead_ms": self.state.overhead_ms,  # fixed ms per step subtracted before reading speeds (speeds.py)
            "overhead_fits": self.state.overhead_fits,
            "stages": stages,
            "history": list(self.history),
            "switches": self.switches,  # all recorded; `history` holds the last HISTORY_LOG of them
            "decisions": list(self.decisions),
        }
