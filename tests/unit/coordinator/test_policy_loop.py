"""The live policy under interleaved (loop placement: a rank runs several stages): a rank's measured compute covers
all its stages, so speeds, the bottleneck and the predicted gain price each rank's summed stages, and a slowed rank
gets a loop plan that moves work off it. The V (zbv): test_policy_v.py."""
import random
from dataclasses import replace

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.rebalancer import Rebalancer
from model_parallel.coordinator.solver import default_solver
from model_parallel.coordinator.status import WorkerState
from model_parallel.messages import StepReport
from tests.unit.coordinator.test_policy_replay import chain_graph, even_plan

CALIBRATION = 3.0


def loop_plan(graph, p, v):
    plan = even_plan(graph, p * v)
    return replace(plan, stages=tuple(replace(s, ranks=(s.stage_id % p,)) for s in plan.stages))


def rank_ms(graph, plan, speeds):
    """Each rank's compute ms under `plan`: its stages' profiled ms summed, calibrated, over its speed."""
    out = {}
    for stage in plan.stages:
        rank = stage.ranks[0]
        out[rank] = out.get(rank, 0.0) + pol.stage_profiled_ms(graph, stage) * CALIBRATION / speeds[rank]
    return out


def test_a_rank_is_priced_by_its_summed_stages():
    graph = chain_graph(8)
    plan = loop_plan(graph, 2, 2)  # every stage 2 ms profiled, each rank 4 ms
    est = pol.estimate_speeds(graph, plan, {r: [ms] * 5 for r, ms in rank_ms(graph, plan, {0: 1.0, 1: 0.5}).items()})
    assert est.predicted_ms == {0: 4.0, 1: 4.0} and est.calibration == pytest.approx(CALIBRATION)
    assert est.speeds == pytest.approx({0: 1.0, 1: 0.5})
    assert pol.predicted_bottleneck_ms(graph, plan, est.speeds, est.calibration) == pytest.approx(24.0)


def replay(graph, plan, speed, config, steps, noise=0.0, seed=0):
    """The policy step by step on a plan of several stages per rank (as the rebalancer runs it), each rank's ms with
    uniform +-`noise`; returns (switches, final state)."""
    rng = random.Random(seed)
    ranks = sorted({r for s in plan.stages for r in s.ranks})
    state = pol.PolicyState(graph, plan, solver=default_solver)
    history, switches = {}, []
    for step in range(steps):
        for rank, ms in rank_ms(graph, state.plan, {r: speed(r, step) for r in ranks}).items():
            history.setdefault(rank, []).append((step, state.plan.version, ms * (1 + rng.uniform(-noise, noise))))
        first = state.version_start_step + 1
        samples = {r: [ms for s, v, ms in h if v == state.plan.version and s >= first] for r, h in history.items()}
        decision, state = pol.decide(state, pol.Samples(step, samples), config)
        if decision.plan is not None:
            switches.append((step, decision))
            state = pol.switched(state, decision.plan, step + 1, predicted=True)
    return switches, state


def test_a_slowed_rank_gets_a_loop_plan_with_half_the_work_and_the_gain_is_delivered():
    graph = chain_graph(24)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=10, window=5)
    switches, state = replay(graph, loop_plan(graph, 2, 2), lambda r, s: 0.5 if r == 1 and s >= 20 else 1.0,
                             config, 60)
    assert len(switches) == 1 and 20 <= switches[0][0] <= 30  # acted on within the window + persist
    decision = switches[0][1]
    plan = state.plan
    assert plan.is_loop_placement and [s.ranks for s in plan.stages] == [(k % 2,) for k in range(4)]
    held = {r: sum(len(plan.stages[k].node_ids) for k in plan.stages_of_rank(r)) for r in (0, 1)}
    assert held[1] == 8 and held[0] == 16 + 1  # rank 1 at half speed: half rank 0's layers (+ the input node)
    # The prediction prices the loop plan by rank sums, which is what the ranks then measure.
    assert decision.current_ms == pytest.approx(12 * CALIBRATION / 0.5)  # rank 1's 12 layers of 1 ms at half speed
    after = max(rank_ms(graph, plan, {0: 1.0, 1: 0.5}).values())
    assert decision.predicted_ms == pytest.approx(after) and decision.gain == pytest.approx(1 - after / decision.current_ms)
    assert decision.gain > 0.3


def first_switch(schedule, place=None, rebalancer_setup=None):
    """A rebalancer under `schedule` on `place(graph)` (default: a 2-rank loop), rank 1 twice as slow: run until the
    first switch is sent; returns (rebalancer, commands sent). `rebalancer_setup(rebalancer)` runs before."""
    graph = chain_graph(8)
    rebalancer = Rebalancer(graph, (place or (lambda g: loop_plan(g, 2, 2)))(graph), pol.PolicyConfig(cooldown_steps=5),
                            default_solver, auto=True, world_size=2, schedule=schedule)
    if rebalancer_setup is not None:
        rebalancer_setup(rebalancer)
    workers = {r: WorkerState(rank=r, host="h", pid=r, world_size=2) for r in range(2)}
    sent = []
    for step in range(1, 30):  # rank 1 twice as slow from the start; until the first switch is sent
        if sent:
            break
        for rank in range(2):
            ms = 4.0 * (1 + rank)
            report = StepReport(rank, step, rebalancer.plan.version, rank, ms, ms, 0.0, 0.0, 1.0)
            workers[rank].reports.append(report)
            workers[rank].step = step  # as the server records it
            rebalancer.on_report(workers[rank], report, workers, lambda r, c: sent.append(c) or True, False)
    return rebalancer, sent


@pytest.mark.parametrize("schedule", ["interleaved", "zbinterleaved"])
def test_the_rebalancer_issues_a_loop_plan_under_the_loop_schedules(schedule):
    rebalancer, sent = first_switch(schedule)
    assert len(sent) == 1 and sent[0].plan.is_loop_placement and sent[0].plan.loop_width == 2
    assert rebalancer.history[0]["reason"].startswith("auto: predicted")
    held = {r: sum(len(sent[0].plan.stages[k].node_ids) for k in sent[0].plan.stages_of_rank(r)) for r in (0, 1)}
    assert held[1] < held[0] - 1  # work moved off the slow rank


def test_under_a_memory_cap_a_loop_re_plan_must_fit_each_rank_sum():
    from model_parallel.coordinator.solver import memory_solver
    from model_parallel.errors import PlanError
    from model_parallel.optimizer.memory import Footprint
    from model_parallel.optimizer.synthetic import chain

    graph = chain(20, seed=1)  # with parameter and activation bytes
    plan = memory_solver(1e12, Footprint())(graph, [0, 1, 0, 1], [1.0, 0.5, 1.0, 0.5])
    assert plan.loop_width == 2
    with pytest.raises(PlanError, match=r"no re-plan on 2 worker\(s\) fits their memory: .* on rank 0 \(stages \[0, 2\]"):
        memory_solver(1.0, Footprint())(graph, [0, 1, 0, 1], [1.0, 0.5, 1.0, 0.5])
    # A zbinterleaved job's re-plan is priced by its own footprint (more than interleaved's): a cap between the two
    # passes the interleaved pricing and is refused under zbinterleaved.
    from model_parallel.optimizer.memory import loop_rank_parts, plan_footprint

    def need(schedule: str) -> float:  # the fullest rank's predicted bytes under `schedule`
        footprint = Footprint(schedule=schedule, microbatches=4)
        merged = loop_rank_parts(plan_footprint(graph, plan, footprint), plan, 4, schedule)
        return max(summed["total"] for _, summed in merged.values())
    assert need("zbinterleaved") > need("interleaved")
    between = (need("zbinterleaved") + need("interleaved")) / 2
    assert memory_solver(between, Footprint(schedule="interleaved", microbatches=4))(graph, [0, 1, 0, 1], [1.0, 0.5, 1.0, 0.5])
    with pytest.raises(PlanError, match="zbinterleaved"):
        memory_solver(between, Footprint(schedule="zbinterleaved", microbatches=4))(graph, [0, 1, 0, 1], [1.0, 0.5, 1.0, 0.5])


def test_a_replicated_loop_plan_is_kept_with_the_reason():
    graph = chain_graph(8)
    four = even_plan(graph, 4)  # 2 replicas of a 2-rank loop: replica i of stage k on rank k % 2 + 2i
    plan = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2, s.stage_id % 2 + 2), num_replicas=2)
                                      for s in four.stages))
    samples = {r: [3.0 * (2 if r == 1 else 1)] * 5 for r in range(4)}
    decision, _ = pol.decide(pol.PolicyState(graph, plan, solver=default_solver), pol.Samples(10, samples),
                             pol.PolicyConfig(), force=True)
    assert decision.plan is None and "does not re-plan a replicated plan with several stages per rank" in decision.reason
