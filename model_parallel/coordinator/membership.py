"""Which world and plan the coordinator's job runs: a world the survivors re-formed (`--recover`, a new membership
generation), a world that admitted a joiner (`--join`: the next generation, the joiner a spare) and a coordinator
started again that learns the live job from the workers' registrations.

Both come from the workers' `register` (protocol.py): `generation` (0: the world joined at start), for a
re-formed world `membership` {members, lost, from_step, and after an admission joined}, and the plan the worker runs (`live_version`,
`live_plan`). Runs under the coordinator's lock, before `Roster.register`; a ProtocolError refuses the worker.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

from model_parallel.coordinator.protocol import ProtocolError
from model_parallel.coordinator.rebalancer import Rebalancer
from model_parallel.coordinator.status import Roster
from model_parallel.errors import ModelParallelError
from model_parallel.graph.plan import Plan

logger = logging.getLogger(__name__)


def admit(roster: Roster, rebalancer: Rebalancer, message: Mapping[str, Any]) -> None:
    """Move the job to the generation and plan this worker's registration says it runs (see the docstring)."""
    generation = int(message.get("generation", 0))
    rank = message.get("rank")
    if generation < roster.generation:
        raise ProtocolError(f"rank {rank} registers in membership generation {generation}, but the job re-formed as "
                            f"generation {roster.generation} without it: that process was replaced and does not rejoin")
    if generation > roster.generation:
        new_generation(roster, rebalancer, message, generation)
        return
    learn_live_plan(roster, rebalancer, message)


def _live_plan(rebalancer: Rebalancer, message: Mapping[str, Any], world_size: int) -> Plan:
    """The plan the registering worker runs, checked as a plan the coordinator issues would be."""
    from dataclasses import replace

    from model_parallel.runtime.plancheck import check_plan

    try:
        plan = replace(Plan.from_dict(message["live_plan"], f"rank {message.get('rank')}'s live plan"),
                       version=int(message["live_version"]))
        # Under the schedule the worker says it runs: a re-formed world may run another one than the world before
        # (interleaved's one-stage-per-rank stand-in, cli/recover_schedule.py); workers.py then adopts it.
        return check_plan(rebalancer.graph, plan, world_size, message.get("schedule", rebalancer.schedule)).plan
    except KeyError:
        raise ProtocolError(f"rank {message.get('rank')} registers without the plan it runs (live_plan)") from None
    except ModelParallelError as error:
        raise ProtocolError(f"rank {message.get('rank')} runs a plan this coordinator cannot serve: {error}") from None


def _ranks(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
        raise ProtocolError(f"register: membership {what} must be a list of original ranks, got {str(value)[:80]}")
    return list(value)


def new_generation(roster: Roster, rebalancer: Rebalancer, message: Mapping[str, Any], generation: int) -> None:
    """The survivors re-formed the world: drop the old registrations and the lost ranks' state, serve the new world
    size and the survivors' plan; the policy starts over (its speeds are learned again under the new ranks)."""
    world_size = int(message["world_size"])
    membership = message.get("membership", {})
    members, lost = _ranks(membership.get("members", []), "members"), _ranks(membership.get("lost", []), "lost")
    joined = _ranks(membership.get("joined", []), "joined")  # admitted (--join): spares in the plan the world ran
    from_step = membership.get("from_step", 0)
    if not isinstance(from_step, int) or isinstance(from_step, bool) or from_step < 0:
        raise ProtocolError(f"register: membership from_step must be a step number, got {str(from_step)[:40]}")
    plan = _live_plan(rebalancer, message, world_size)
    spent = max(rebalancer.plan.version, rebalancer.highest_issued, rebalancer.highest_reported)
    if plan.version <= spent:  # every survivor knew less than this coordinator issued: say so, never silently reuse
        logger.warning("the re-formed world runs plan v%d, but this coordinator already spent v%d (a switch no survivor "
                       "received); plan versions it issues from now on go above both", plan.version, spent)
    for worker in roster.workers.values():  # the previous world's connections: its processes re-register or are gone
        if worker.session is not None:
            try:
                worker.session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    previous = roster.generation
    roster.new_generation(generation, world_size, {
        "generation": generation, "lost": lost, "members": members, "world_size": world_size, "from_step": from_step,
        "plan_version": plan.version, "previous_generation": previous, **({"joined": joined} if joined else {})})
    if joined:
        # A member lost while the world re-formed for the admission (recovery.reform's retry): the joiner then takes a
        # current rank the plan it ran places a stage on, and is no spare; both said, not "a spare" and no loss.
        placed = {r for stage in plan.stages for r in stage.ranks}
        spare = not any(members.index(j) in placed for j in joined if j in members)
        lost_text = f"; original rank(s) {lost} lost while it re-formed" if lost else ""
        role = ("the joiner a spare until a rebalance gives it a share" if spare else
                "the joiner holds the stage of the current rank it took")
        rebalancer.adopt(plan, from_step, world_size, f"admission: generation {generation}, original rank(s) {joined} "
                                                      f"joined{' as spare(s)' if spare else ''}{lost_text}; the plan the "
                                                      f"world ran")
        logger.warning("membership generation %d: original rank(s) %s joined%s; a world of %d (original ranks %s) "
                       "from step %d; plan v%d (the plan it ran, %s) is live\n%s", generation, joined, lost_text,
                       world_size, members, from_step, plan.version, role, plan.table())
        return
    rebalancer.adopt(plan, from_step, world_size, f"recovery: generation {generation}, original rank(s) {lost} lost; "
                                                  f"the survivors' even split for {world_size} rank(s)")
    logger.warning("membership generation %d: original rank(s) %s lost; the survivors re-formed a world of %d "
                   "(original ranks %s) from step %d; plan v%d (their even split) is live\n%s", generation, lost,
                   world_size, members, from_step, plan.version, plan.table())


def learn_live_plan(roster: Roster, rebalancer: Rebalancer, message: Mapping[str, Any]) -> None:
    """A worker runs a newer plan than this coordinator knows (the coordinator was started again while the job
    ran): make it the live plan, so plans issued from here go above it and the policy measures the right one."""
    version = message.get("live_version")
    if not isinstance(version, int) or version <= max(rebalancer.plan.version, rebalancer.highest_issued):
        return
    rebalancer.highest_reported = max(rebalancer.highest_reported, version)
    if "live_plan" not in message or message["world_size"] != roster.world_size:
        return  # only its version (a rank other than 0, which learns switches): rank 0's registration brings the plan
    step = message.get("step", 0) if isinstance(message.get("step"), int) else 0
    plan = _live_plan(rebalancer, message, roster.world_size)
    rebalancer.adopt(plan, step, roster.world_size, f"learned from rank {message.get('rank')}: the plan the job runs")
    roster.learned = {"plan_version": plan.version, "from_rank": message.get("rank"), "at_step": step}
    roster.dirty = True
    logger.warning("learned the live job from rank %s: plan v%d at step %d (this coordinator started while the job "
                   "ran); plans it issues go above it\n%s", message.get("rank"), plan.version, step, plan.table())
