"""`ctl rebalance` (policy.decide with force=True) does not switch to a plan predicted no faster: under a V, a re-plan
that only moves the cut between the V's two middle stages (one rank's) changes no rank's time, and issuing it would
pause the workers for nothing. The answer says "already balanced (predicted gain 0 %)"; a real gain still switches."""
import threading
from dataclasses import replace

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.ctl import CtlHandler
from model_parallel.coordinator.rebalancer import Rebalancer
from model_parallel.coordinator.solver import default_solver
from model_parallel.coordinator.status import Roster, WorkerState
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import StepReport
from tests.unit.coordinator.test_policy_loop import CALIBRATION, rank_ms
from tests.unit.coordinator.test_policy_replay import chain_graph

ALREADY = "already balanced (predicted gain 0 %)"


def v_cut(graph, sizes):
    """A 2-rank V (stages on ranks 0, 1, 1, 0) with `sizes` layers per stage (the input rides with stage 0)."""
    ids = list(graph.topological_order)
    bounds = [0, 1 + sizes[0]]
    for size in sizes[1:]:
        bounds.append(bounds[-1] + size)
    assert bounds[-1] == len(ids)
    return Plan(tuple(StagePlan(k, tuple(ids[bounds[k]:bounds[k + 1]]), ranks=(min(k, 3 - k),)) for k in range(4)))


def forced(graph, plan, speeds):
    """ctl rebalance's decision on `plan` with each rank measuring its stages' calibrated ms over its speed."""
    samples = {r: [ms] for r, ms in rank_ms(graph, plan, speeds).items()}
    decision, _ = pol.decide(pol.PolicyState(graph, plan, solver=default_solver), pol.Samples(10, samples),
                             pol.PolicyConfig(), force=True)
    return decision


def test_a_re_plan_that_only_moves_the_v_s_middle_cut_is_not_issued():
    graph = chain_graph(24)
    plan = v_cut(graph, [6, 2, 10, 6])  # rank 1's 12 layers cut 2 + 10: the solver would cut 6 + 6, no rank faster
    candidate = default_solver(graph, [0, 1, 1, 0], [1.0] * 4)
    assert [len(s.node_ids) for s in candidate.stages] != [len(s.node_ids) for s in plan.stages]  # not "the same"
    decision = forced(graph, plan, {0: 1.0, 1: 1.0})
    assert decision.plan is None and decision.reason == ALREADY
    assert decision.gain == 0.0 and decision.current_ms == decision.predicted_ms == 12 * CALIBRATION


def test_a_real_gain_is_still_issued_by_ctl_rebalance():
    graph = chain_graph(24)
    decision = forced(graph, v_cut(graph, [4, 2, 10, 8]), {0: 1.0, 1: 1.0})  # every cut off, rank sums still 12, 12
    slowed = forced(graph, v_cut(graph, [6, 2, 10, 6]), {0: 1.0, 1: 0.5})  # rank 1 at half speed: move work off it
    assert slowed.plan is not None and slowed.plan.is_v_placement and slowed.gain > 0.3
    assert decision.plan is None and decision.reason == ALREADY


def test_ctl_rebalance_answers_already_balanced_and_sends_nothing():
    graph = chain_graph(24)
    plan = v_cut(graph, [6, 2, 10, 6])
    rebalancer = Rebalancer(graph, plan, pol.PolicyConfig(), default_solver, auto=False, world_size=2, schedule="zbv")
    roster = Roster(2)
    roster.workers = {r: WorkerState(rank=r, host="h", pid=r, world_size=2) for r in range(2)}
    for rank, ms in rank_ms(graph, plan, {0: 1.0, 1: 1.0}).items():
        for step in range(1, 4):  # past the warm-up step
            roster.workers[rank].reports.append(StepReport(rank, step, 0, plan.stages_of_rank(rank)[0], ms, ms, 0.0,
                                                           0.0, 1.0))
            roster.workers[rank].step = step
    sent = []
    handler = CtlHandler(threading.RLock(), roster, rebalancer, lambda r, c: sent.append(c) or True, lambda: {})
    assert handler.handle("rebalance", {}) == {"switched": False, "reason": ALREADY}
    assert sent == [] and rebalancer.pending is None and rebalancer.history == []
    # Rank 1 at half speed: the same request switches (a V that moves work off it).
    for report in roster.workers[1].reports:
        roster.workers[1].reports[roster.workers[1].reports.index(report)] = replace(report, compute_ms=2 * report.compute_ms)
    answer = handler.handle("rebalance", {})
    assert answer["switched"] is True and len(sent) == 1 and sent[0].plan.is_v_placement
