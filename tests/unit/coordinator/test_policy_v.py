"""The live policy under zbv (a V: rank r runs stages r and 2p-1-r): a rank's measured compute covers both its stages,
so the policy prices each rank's summed stages and re-plans a V (optimizer/loop.py `v_rank_plan`) as it re-plans a
loop for the interleaved schedules (test_policy_loop.py): a slowed rank gets less, balanced noise never switches,
and `--schedule auto` chooses zbv again for the new V."""
from dataclasses import replace

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.solver import default_solver, memory_solver
from model_parallel.errors import PlanError
from tests.unit.coordinator.test_policy_loop import CALIBRATION, first_switch, rank_ms, replay
from tests.unit.coordinator.test_policy_replay import chain_graph, even_plan


def v_plan(graph, p=2):
    plan = even_plan(graph, 2 * p)
    return replace(plan, stages=tuple(replace(s, ranks=(min(s.stage_id, 2 * p - 1 - s.stage_id),)) for s in plan.stages))


def held(plan, rank):
    return sum(len([n for n in plan.stages[k].node_ids if n != "input0"]) for k in plan.stages_of_rank(rank))


def test_a_slowed_rank_gets_a_v_plan_with_half_the_work_and_the_gain_is_delivered():
    graph = chain_graph(24)
    config = pol.PolicyConfig(threshold=0.1, cooldown_steps=10, window=5)
    switches, state = replay(graph, v_plan(graph), lambda r, s: 0.5 if r == 1 and s >= 20 else 1.0, config, 60)
    assert len(switches) == 1 and 20 <= switches[0][0] <= 30  # acted on within the window + persist
    decision, plan = switches[0][1], state.plan
    assert plan.is_v_placement and [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)]
    assert (held(plan, 0), held(plan, 1)) == (16, 8)  # rank 1 (stages 1 and 2) at half speed: half rank 0's layers
    assert decision.current_ms == pytest.approx(12 * CALIBRATION / 0.5)  # rank 1's 12 layers of 1 ms at half speed
    after = max(rank_ms(graph, plan, {0: 1.0, 1: 0.5}).values())  # what the ranks then measure: the prediction
    assert decision.predicted_ms == pytest.approx(after) and decision.gain > 0.3
    assert plan.extra["time_per_minibatch_of"] == "slowest rank, its stages summed"


@pytest.mark.parametrize("seed", range(3))
def test_noisy_but_balanced_speeds_never_switch_a_v(seed):
    graph = chain_graph(24)
    switches, state = replay(graph, v_plan(graph, 3), lambda r, s: 1.0, pol.PolicyConfig(), 120, noise=0.08, seed=seed)
    assert switches == [] and state.plan.version == 0


def test_the_rebalancer_issues_a_v_plan_under_zbv():
    rebalancer, sent = first_switch("zbv", v_plan)
    assert len(sent) == 1 and sent[0].plan.is_v_placement and sent[0].plan.v_width == 2
    assert rebalancer.history[0]["reason"].startswith("auto: predicted")
    assert held(sent[0].plan, 1) < held(sent[0].plan, 0)  # work moved off the slow rank, still in a V
    assert "time per minibatch (slowest rank, its stages summed)" in sent[0].plan.table()


def test_schedule_auto_chooses_zbv_again_for_the_new_v():
    def served_auto(rebalancer):  # the workers registered with --schedule auto (no schedule the coordinator knows)
        rebalancer.schedule_auto, rebalancer.num_microbatches = True, 4

    rebalancer, sent = first_switch(None, v_plan, served_auto)
    assert len(sent) == 1 and sent[0].plan.is_v_placement and sent[0].schedule == "zbv"
    assert rebalancer.history[0]["schedule"] == "zbv"
    assert "interleaved refused: placement: not a loop" in sent[0].plan.extra["schedule"]["line"]


def test_under_a_memory_cap_a_v_re_plan_must_fit_each_rank_sum():
    from model_parallel.optimizer.memory import Footprint
    from model_parallel.optimizer.synthetic import chain

    graph = chain(20, seed=1)  # with parameter and activation bytes
    assert memory_solver(1e12, Footprint())(graph, [0, 1, 1, 0], [1.0, 0.5, 0.5, 1.0]).v_width == 2
    with pytest.raises(PlanError, match=r"no re-plan on 2 worker\(s\) fits their memory: .* rank 0 \(stages \[0, 3\]"):
        memory_solver(1.0, Footprint())(graph, [0, 1, 1, 0], [1.0, 0.5, 0.5, 1.0])


def test_a_replicated_v_plan_is_kept_with_the_reason():
    graph = chain_graph(8)
    four = even_plan(graph, 4)  # 2 replicas of a 2-rank V: replica i of stage k on rank min(k, 3-k) + 2i
    first = [min(k, 3 - k) for k in range(4)]
    plan = replace(four, stages=tuple(replace(s, ranks=(first[s.stage_id], first[s.stage_id] + 2), num_replicas=2)
                                      for s in four.stages))
    assert plan.v_width == 2
    decision, _ = pol.decide(pol.PolicyState(graph, plan, solver=default_solver),
                             pol.Samples(10, {r: [3.0 * (2 if r == 1 else 1)] * 5 for r in range(4)}),
                             pol.PolicyConfig(), force=True)
    assert decision.plan is None and "does not re-plan a replicated plan with several stages per rank" in decision.reason
