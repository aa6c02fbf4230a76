"""When the coordinator gives a sent switch up (rebalancer.py): only with the connection it went out on, or after
PENDING_TIMEOUT_S without an answer; never because rank 0's reports lag by many steps (they do under load)."""
from __future__ import annotations

import logging
import socket

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator import rebalancer as rb
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import StepReport
from support import wait_for
from support.coordinators import chain_graph, live_coordinator

TOKEN = b"switch-loss-token"


def _report(rank: int, step: int, version: int) -> StepReport:
    return StepReport(rank=rank, step=step, plan_version=version, stage=rank, step_ms=20.0, compute_ms=4.0, comm_ms=1.0,
                      idle_ms=0.0, samples_per_s=400.0)


def _cut(graph, at: int) -> dict:
    ids = list(graph.topological_order)
    return Plan((StagePlan(0, tuple(ids[:at]), ranks=(0,)), StagePlan(1, tuple(ids[at:]), ranks=(1,)))).to_dict()


class _World:
    """A manual-policy coordinator on an 8-layer chain and two in-process worker channels at step 2 under plan v0."""

    def __init__(self, coord, channels):
        self.coord, self.channels = coord, channels
        self.graph = coord.rebalancer.graph

    def set_plan(self, at: int) -> int:
        with CtlClient(self.coord.address, TOKEN) as ctl:
            return ctl.request("set-plan", plan=_cut(self.graph, at))["version"]


@pytest.fixture
def world():
    with live_coordinator(TOKEN, chain_graph(8), policy="manual", config=pol.PolicyConfig(window=3)) as coord:
        channels = [CoordinatorChannel(coord.address, TOKEN, rank=r, world_size=2) for r in range(2)]
        try:
            for channel in channels:
                channel.report(_report(channel.rank, 2, 0))
            wait_for(lambda: all(w.step >= 2 for w in coord.workers.values()), what="reports")
            yield _World(coord, channels)
        finally:
            for channel in channels:
                channel.close()


def test_a_switch_whose_reports_lag_many_steps_stays_pending_until_its_version_is_reported(world) -> None:
    # The CI failure this guards: under load the coordinator heard of rank 0's step 25 under v0 before the first
    # report of v1 (sent after step 4); a step count gave v1 up, the policy sent v2, and v1's reports were ignored.
    assert world.set_plan(3) == 1
    assert wait_for(world.channels[0].poll, what="switch").plan.version == 1
    world.channels[0].report(_report(0, 300, 0))  # a report made before rank 0 read the switch, arriving late
    wait_for(lambda: world.coord.workers[0].step >= 300, what="the lagging report")
    assert world.coord.rebalancer.pending is not None and world.coord.rebalancer.pending.plan.version == 1
    world.channels[0].report(_report(0, 301, 1))
    wait_for(lambda: world.coord.plan.version == 1, what="the confirmation")
    assert world.coord.rebalancer.history[-1]["applied_at_step"] == 301


def test_a_switch_whose_connection_ended_is_given_up_and_still_confirmed_late_under_a_newer_one(
        world, caplog: pytest.LogCaptureFixture) -> None:
    assert world.set_plan(3) == 1
    assert wait_for(world.channels[0].poll, what="switch").plan.version == 1  # rank 0 has it ...
    first = world.coord.workers[0]
    with caplog.at_level(logging.WARNING, logger="model_parallel.coordinator.rebalancer"):
        world.channels[0].session.sock.shutdown(socket.SHUT_RDWR)  # ... and its connection ends before it answers
        wait_for(lambda: world.coord.rebalancer.pending is None, what="the switch given up on")
        assert any("plan v1 was not confirmed: the connection to rank 0 it went out on ended" in r.getMessage()
                   for r in caplog.records)
        assert world.coord.plan.version == 0
        wait_for(lambda: world.coord.workers[0] is not first and world.coord.workers[0].session is not None,
                 what="rank 0 reconnected")
        assert world.set_plan(5) == 2  # a new plan may be issued now
        world.channels[0].report(_report(0, 31, 1))  # rank 0 applied v1 all the same
        wait_for(lambda: world.coord.plan.version == 1, what="the late confirmation")
        assert any("plan v1 was applied after all (rank 0 reports it at step 31); plan v2, sent since, stays pending"
                   in r.getMessage() for r in caplog.records)
    assert world.coord.rebalancer.pending.plan.version == 2
    world.channels[0].report(_report(0, 32, 2))
    wait_for(lambda: world.coord.plan.version == 2, what="v2 confirmed")
    assert [(h["version"], h["applied_at_step"]) for h in world.coord.rebalancer.history] == [(1, 31), (2, 32)]


def test_a_switch_without_an_answer_for_the_timeout_is_given_up(world) -> None:
    now = [0.0]
    world.coord.rebalancer.clock = lambda: now[0]
    assert world.set_plan(3) == 1
    world.channels[0].report(_report(0, 3, 0))
    wait_for(lambda: world.coord.workers[0].step >= 3, what="a report")
    assert world.coord.rebalancer.pending is not None  # not yet: the clock has not moved
    now[0] = rb.PENDING_TIMEOUT_S + 1
    world.channels[0].report(_report(0, 4, 0))
    wait_for(lambda: world.coord.rebalancer.pending is None, what="given up after the timeout")
    assert world.coord.rebalancer.dropped.plan.version == 1
