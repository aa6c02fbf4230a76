"""The coordinator under the interleaved schedule: it accepts the workers' loop-placement plan, reads a rank's
reports, and `ctl set-plan` issues a loop plan (refusing any other). The auto policy under interleaved:
test_policy_loop.py."""
from dataclasses import replace

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.rebalancer import Rebalancer
from model_parallel.coordinator.solver import default_solver
from model_parallel.coordinator.status import WorkerState
from model_parallel.errors import PlanError
from model_parallel.messages import StepReport
from tests.unit.coordinator.test_policy_replay import chain_graph, even_plan


def test_reports_of_a_rank_with_two_stages_are_read_and_set_plan_issues_loop_plans_only():
    graph = chain_graph(8)
    four = even_plan(graph, 4)
    loop = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in four.stages))
    rebalancer = Rebalancer(graph, loop, pol.PolicyConfig(), default_solver, auto=True, world_size=2,
                            schedule="interleaved")
    workers = {r: WorkerState(rank=r, host="h", pid=r, world_size=2) for r in range(2)}
    sent = []
    for step in range(1, 30):  # no worker step recorded (the server's job): the policy does not run, nothing is sent
        for rank in range(2):
            report = StepReport(rank, step, 0, rank, 1.0 + rank, 1.0 + rank, 0.0, 0.0, 1.0)
            workers[rank].reports.append(report)
            rebalancer.on_report(workers[rank], report, workers, lambda r, c: sent.append(c) or True, False)
    assert sent == [] and not rebalancer._mismatch_warned  # the report's stage is the rank's first one
    # ctl set-plan: a loop plan is issued (the workers switch loop to loop), any other plan is refused
    with pytest.raises(PlanError, match="needs loop placement over p >= 2 ranks"):
        rebalancer.issue(even_plan(graph, 2), "ctl set-plan", 30, lambda r, c: sent.append(c) or True, predicted=False)
    assert sent == []
    assert rebalancer.issue(loop, "ctl set-plan", 30, lambda r, c: sent.append(c) or True, predicted=False) is not None
    assert len(sent) == 1 and sent[0].plan.is_loop_placement
