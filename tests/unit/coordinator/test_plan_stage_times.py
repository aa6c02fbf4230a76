"""The coordinator attaches the per-stage times it measured to every plan it issues (`plan.extra["stage_times"]`), for
every job: the workers list-build their zero-bubble order from them (runtime/step/list_order.py); and learns whether
the workers list-build it at all (`--schedule_order`)."""
from __future__ import annotations

import pytest
import torch

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient
from model_parallel.coordinator.rechoose import measured_times
from model_parallel.graph.plan import Plan, StagePlan, plan_stage_times
from model_parallel.messages import StepReport
from support import wait_for
from support.coordinators import chain_graph, live_coordinator

torch.set_num_threads(1)
TOKEN = b"stage-times-token"


def _report(rank: int, step: int) -> StepReport:
    return StepReport(rank=rank, step=step, plan_version=0, stage=rank, step_ms=20.0, compute_ms=4.0 * (rank + 1),
                      comm_ms=1.0, idle_ms=0.0, samples_per_s=400.0)


@pytest.mark.parametrize("num_microbatches", [4, None])
def test_a_plan_issued_carries_the_measured_stage_times(num_microbatches) -> None:
    graph = chain_graph(8)
    ids = list(graph.topological_order)
    loop = Plan(tuple(StagePlan(k, tuple(part), ranks=(k % 2,))  # 4 stages, stage k on rank k % 2
                      for k, part in enumerate([ids[:3], ids[3:5], ids[5:7], ids[7:]])))
    with live_coordinator(TOKEN, graph, policy="manual", config=pol.PolicyConfig(window=3)) as coord:
        order = "list" if num_microbatches else "fixed"  # what a re-choice under auto prices (rechoose.py)
        channels = [CoordinatorChannel(coord.address, TOKEN, rank=r, world_size=2, schedule="zbinterleaved",
                                       num_microbatches=num_microbatches, schedule_order=order) for r in range(2)]
        try:
            for step in range(3):
                for channel in channels:
                    channel.report(_report(channel.rank, step))
            wait_for(lambda: all(w.step >= 2 for w in coord.workers.values()), what="reports")
            with CtlClient(coord.address, TOKEN) as ctl:
                ctl.request("set-plan", plan=loop.to_dict())
            command = wait_for(channels[0].poll, what="switch")
            assert coord.rebalancer.list_order is (order == "list")
            if num_microbatches is None:  # a worker that does not say its m: times per microbatch are unknown
                assert "stage_times" not in command.plan.extra
                return
            # Rank 1 reported twice rank 0's compute: its stages take twice their profiled share (no weights: W = 0)
            want = measured_times(graph, loop, {0: 1.0, 1: 0.5}, coord.rebalancer.calibration, 4)
            given = plan_stage_times(command.plan)
            assert given == tuple((t.forward_ms, t.input_ms, t.weight_ms) for t in want)
            assert given == ((0.25, 0.25, 0.0), (0.5, 0.5, 0.0), (0.25, 0.25, 0.0), (0.5, 0.5, 0.0))
        finally:
            for channel in channels:
                channel.close()
