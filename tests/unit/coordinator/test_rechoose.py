"""`--schedule auto` chosen again at a live switch (coordinator/rechoose.py): measured times per stage, speeds and a
memory limit that change the choice, the `Command.schedule` field, the engine's config swap, and the coordinator
sending the choice with the plan."""
from __future__ import annotations

import logging

import pytest
import torch

from model_parallel.cli.ctl import format_status
from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient
from model_parallel.coordinator.rechoose import measured_times, rechoose
from model_parallel.errors import ConfigError, InfeasibleError, ProtocolError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import Command, StepReport
from model_parallel.optimizer.memory import Footprint, MemoryLimit
from model_parallel.optimizer.simulate import StageTimes
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.wire.migration import switched_config
from support import wait_for
from support.coordinators import chain_graph, live_coordinator

torch.set_num_threads(1)
MB = 1e6
TOKEN = b"rechoose-token"


def chain(weighted: tuple[bool, ...]) -> Graph:
    """Input -> n0 -> ...: each layer 1 ms forward, 2 ms backward, 10 MB out; 1 MB of weights where `weighted`."""
    nodes = [Node("x", "Input0", activation_size=10 * MB)]
    nodes += [Node(f"n{i}", f"Linear({i})", forward_ms=1.0, backward_ms=2.0, parameter_size=MB if w else 0,
                   activation_size=10 * MB) for i, w in enumerate(weighted)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def cut(graph: Graph, at: int, version: int = 1) -> Plan:
    ids = list(graph.topological_order)
    return Plan((StagePlan(0, tuple(ids[:at]), ranks=(0,)), StagePlan(1, tuple(ids[at:]), ranks=(1,))), version=version)


def test_measured_times_are_the_profiles_split_of_each_ranks_measured_ms() -> None:
    graph = chain((True, True, True, True))
    # Calibration 2 (this machine runs the profile's ms twice as long), m = 4, rank 1 at half speed.
    times = measured_times(graph, cut(graph, 3), {0: 1.0, 1: 0.5}, 2.0, 4)
    assert times == (StageTimes(1.0, 2.0, 1.0, 1.0), StageTimes(2.0, 4.0, 2.0, 2.0))
    # A graph without timings: the coordinator's cost proxy (3 MB of weights: 3 "ms" forward) is the whole step,
    # split 1 : 2 into forward and backward, I = W.
    untimed = Graph((Node("x", "Input0"), Node("n0", "Linear(0)", parameter_size=3 * MB),
                     Node("n1", "Linear(1)", parameter_size=3 * MB)), (("x", "n0"), ("n0", "n1")))
    proxied = measured_times(pol.with_cost_proxy(untimed), cut(untimed, 2), {}, 1.0, 1)
    assert proxied == (StageTimes(1.0, 2.0, 1.0, 1.0), StageTimes(1.0, 2.0, 1.0, 1.0))


def test_new_speeds_change_the_choice_for_the_same_plan() -> None:
    graph = chain((False, False, True, True))
    plan = cut(graph, 4)  # stage 1 (n3) alone has weights: a W to defer only there
    even = rechoose(graph, plan, 2, {0: 1.0, 1: 1.0}, 1.0, 4)
    assert even.name == "1f1b" and [(p.name, p.step_ms) for p in even.predictions] == [
        ("1f1b", 9.0), ("gpipe", 9.75), ("zbh1", 9.0)]  # a tie keeps 1f1b
    slowed = rechoose(graph, plan, 2, {0: 1.0, 1: 0.5}, 1.0, 4)
    assert slowed.name == "zbh1" and slowed.chosen.step_ms == 9.25
    line = slowed.line(" after plan v1")
    assert line.startswith("schedule auto after plan v1: chose zbh1 (predicted 9.2 ms/step, bubble ")
    assert "1f1b 9.8 ms, gpipe 10.5 ms, interleaved refused: placement: not a loop" in line
    assert "zbv refused: placement: not a V" in line


def test_a_migration_that_makes_a_rank_heavier_refuses_gpipe_by_memory() -> None:
    graph = chain((True, True, True, True))
    # SGD, m = 4: gpipe holds every microbatch's activations, 84 and 124 MB on the even split, 126 MB on stage 0
    # once it holds 3 layers; 1f1b and zbh1 at most 66 MB.
    limit = MemoryLimit(125 * MB, Footprint("sgd", "1f1b", 4, 1.0))
    before = rechoose(graph, cut(graph, 3, 0), 2, {}, 1.0, 4, limit)
    assert "gpipe" in [p.name for p in before.predictions]
    after = rechoose(graph, cut(graph, 4, 1), 2, {0: 2.0, 1: 1.0}, 1.0, 4, limit)
    assert after.name in ("1f1b", "zbh1") and "gpipe" not in [p.name for p in after.predictions]
    assert dict(after.refused)["gpipe"].startswith("memory: plan v1 puts a predicted 0.126 GB on stage 0")
    with pytest.raises(InfeasibleError, match=r"plan v1: schedule auto: no schedule can run this job \(1f1b: memory: plan v1 "
                                        r"puts a predicted"):
        rechoose(graph, cut(graph, 4, 1), 2, {}, 1.0, 4, MemoryLimit(10 * MB, Footprint("sgd", "1f1b", 4, 1.0)))


def test_the_switch_command_carries_a_schedule_from_the_fixed_set() -> None:
    plan = cut(chain((True, True)), 2)
    command = Command.switch(plan, "test", schedule="zbh1")
    assert Command.from_json(command.to_json()) == command
    assert "schedule" not in Command.switch(plan).to_dict()  # absent: the message it was before the field
    assert Command.from_dict(Command.switch(plan).to_dict()).schedule is None
    with pytest.raises(ProtocolError, match=r"`schedule` names the schedule a 'switch' runs, one of 1f1b, gpipe, "
                                            r"interleaved, zbh1, zbinterleaved, zbv; got 'fastest'"):
        Command.from_dict({**command.to_dict(), "schedule": "fastest"})
    with pytest.raises(ProtocolError, match="got 'pipedream'"):  # no flush: auto never picks it
        Command.switch(plan, schedule="pipedream")
    with pytest.raises(ProtocolError, match="got 'zbh1' in a 'stop' command"):
        Command.from_dict({"kind": "stop", "schedule": "zbh1"})
    with pytest.raises(ProtocolError, match="runs schedule 'gpipe' but its plan's table says 'zbh1'"):
        Command.switch(Plan(plan.stages, extra={"schedule": {"name": "zbh1"}}), schedule="gpipe")
    with pytest.raises(ProtocolError, match="`schedule` must be a schedule's name or absent"):
        Command.from_dict({**command.to_dict(), "schedule": {"name": "zbh1"}})


def test_only_a_schedule_auto_chose_changes_at_a_switch() -> None:
    fixed = TrainConfig(schedule="1f1b")
    assert switched_config(fixed, None) is fixed and switched_config(fixed, "1f1b") is fixed
    with pytest.raises(ConfigError, match="runs the fixed schedule '1f1b'; only a job started with --schedule auto"):
        switched_config(fixed, "zbh1")
    auto = TrainConfig(schedule="1f1b", schedule_auto=True)
    assert switched_config(auto, "zbh1") == TrainConfig(schedule="zbh1", schedule_auto=True)


def _report(rank: int, step: int, version: int) -> StepReport:
    return StepReport(rank=rank, step=step, plan_version=version, stage=rank, step_ms=20.0, compute_ms=4.0, comm_ms=1.0,
                      idle_ms=0.0, samples_per_s=400.0)


@pytest.mark.parametrize("auto", [True, False])
def test_the_coordinator_sends_the_schedule_it_chose_for_the_new_plan(auto: bool, caplog: pytest.LogCaptureFixture) -> None:
    graph = chain_graph(8)
    ids = list(graph.topological_order)
    loop = Plan(tuple(StagePlan(k, tuple(part), ranks=(k % 2,))  # 4 stages, stage k on rank k % 2
                      for k, part in enumerate([ids[:3], ids[3:5], ids[5:7], ids[7:]])))
    with live_coordinator(TOKEN, graph, policy="manual", config=pol.PolicyConfig(window=3)) as coord:
        schedule = "zbh1" if auto else "interleaved"
        channels = [CoordinatorChannel(coord.address, TOKEN, rank=r, world_size=2, schedule=schedule, schedule_auto=auto,
                                       num_microbatches=4) for r in range(2)]
        try:
            for step in range(3):
                for channel in channels:
                    channel.report(_report(channel.rank, step, 0))
            wait_for(lambda: all(w.step >= 2 for w in coord.workers.values()), what="reports")
            with caplog.at_level(logging.INFO, logger="model_parallel.coordinator.rebalancer"), \
                    CtlClient(coord.address, TOKEN) as ctl:
                ctl.request("set-plan", plan=loop.to_dict())
            command = wait_for(channels[0].poll, what="switch")
            lines = [r.getMessage() for r in caplog.records if "schedule auto" in r.getMessage()]
            if not auto:  # a fixed schedule: nothing chosen, the switch names none
                assert command.schedule is None and lines == [] and "schedule" not in command.plan.extra
                assert "schedule" not in coord.rebalancer.history[-1]
                return
            # chain_graph's nodes have no weights: zbinterleaved has no W to defer and ties; interleaved holds less.
            assert command.schedule == "interleaved"
            assert command.plan.extra["schedule"]["chosen_by"] == "auto"
            assert lines and lines[0].startswith("schedule auto after plan v1: chose interleaved (predicted ")
            assert "1f1b refused: placement: several stages per rank" in lines[0]
            assert "split F/B by the profile's ratio" in lines[0]
            assert "schedule interleaved (chosen by auto)" in command.plan.table()
            assert coord.rebalancer.schedule == "zbh1"  # until the workers run it
            for channel in channels:
                channel.report(_report(channel.rank, 3, 1))
            wait_for(lambda: coord.rebalancer.pending is None, what="the switch confirmed")
            assert coord.rebalancer.schedule == "interleaved"
            assert coord.rebalancer.history[-1]["schedule"] == "interleaved"
            assert "applied at step 3: ctl set-plan (schedule interleaved)" in format_status(coord.status())
        finally:
            for channel in channels:
                channel.close()
