"""One noisy window on a healthy rank must not misplace layers (issue 37 item 5): the speeds a plan is solved for put
ranks within the noise band of each other at their group's median (coordinator/robust.py), while a straggler keeps its
measured speed and is still acted on within 10 steps."""
import random

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.robust import banded_speeds
from model_parallel.coordinator.solver import default_solver
from model_parallel.errors import PlanError
from tests.unit.coordinator.test_policy_loop import loop_plan, replay as loop_replay
from tests.unit.coordinator.test_policy_replay import chain_graph, even_plan, replay

CLEAN = {0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0}  # rank 1 a 2x straggler from step 0
# What one 5-step window read in bench/schedules.py's straggler row (docs/runtime.md): rank 3 10-15 % slow.
BENCH_WINDOW = {0: 1.0, 1: 0.47, 2: 0.93, 3: 0.85}


def test_ranks_within_the_band_share_their_median_and_a_straggler_keeps_its_speed():
    assert banded_speeds(BENCH_WINDOW, 0.2) == {0: 0.93, 1: 0.47, 2: 0.93, 3: 0.93}
    assert banded_speeds(BENCH_WINDOW, 0.0) == BENCH_WINDOW
    # two stragglers within the band of each other form their own group
    assert banded_speeds({0: 1.0, 1: 0.5, 2: 0.46, 3: 0.95}, 0.2) == pytest.approx({0: 0.975, 1: 0.48, 2: 0.48, 3: 0.975})
    with pytest.raises(PlanError, match="noise_band"):
        pol.PolicyConfig(noise_band=1.0)


def per_rank_layers(plan):
    out = {}
    for stage in plan.stages:
        out[stage.ranks[0]] = out.get(stage.ranks[0], 0) + len([n for n in stage.node_ids if n != "input0"])
    return out


def first_switch(graph, plan, window_speeds, run):
    """The plan the policy switches to when the first window (steps 1-5) reads `window_speeds`, then `CLEAN`."""
    switches, state, decisions = run(graph, plan, lambda r, s: (window_speeds if s <= 5 else CLEAN)[r])
    assert switches and switches[0] == 5, switches
    return decisions[5], switches, state


def straight(graph, plan, speed):
    return replay(graph, plan, speed, pol.PolicyConfig(), 60)


def looped(graph, plan, speed):
    switches, state = loop_replay(graph, plan, speed, pol.PolicyConfig(), 60)
    return [s for s, _ in switches], state, {s: d for s, d in switches}


@pytest.mark.parametrize("placement", ["straight", "loop"])
@pytest.mark.parametrize("noisy", [BENCH_WINDOW, {**CLEAN, 3: 1 / 1.12}, {**CLEAN, 2: 1.12}, {**CLEAN, 0: 1 / 1.12}],
                         ids=["bench-window", "rank3-12pc-slow", "rank2-12pc-fast", "rank0-12pc-slow"])
def test_a_noisy_window_on_a_healthy_rank_gives_the_plan_solved_for_clean_speeds(placement, noisy):
    graph = chain_graph(24)
    plan, run = (even_plan(graph, 4), straight) if placement == "straight" else (loop_plan(graph, 4, 2), looped)
    clean, _, _ = first_switch(graph, plan, CLEAN, run)
    decision, switches, state = first_switch(graph, plan, noisy, run)
    assert per_rank_layers(decision.plan) == per_rank_layers(clean.plan) == {0: 7, 1: 3, 2: 7, 3: 7}
    # The very same plan. Under a loop the per-rank layers (the bottleneck) are; the cut between one rank's two stages
    # follows the solve's absolute times (calibration, group median), which moves nothing across ranks.
    if placement == "straight":
        assert pol.stage_nodes(decision.plan) == pol.stage_nodes(clean.plan)
    assert switches == [5], switches  # and it stays: the noise is gone, the plan was right
    assert decision.solved_for[1] < 0.6 and len({round(decision.solved_for[r], 9) for r in (0, 2, 3)}) == 1


def test_detection_stays_within_10_steps_after_a_noisy_window_and_right_after_a_switch():
    """The calibration switch solved from a noisy window, then rank 2 turns 2x slower two steps after it went live,
    and later rank 3 (in the steady state): each is acted on within 10 steps, and work moves off every slow rank."""
    graph = chain_graph(24)

    def speed(rank, step):
        if step <= 5:
            return BENCH_WINDOW[rank]
        return {1: 0.5, 2: 0.5 if step >= 8 else 1.0}.get(rank, 1.0)

    switches, state, decisions = replay(graph, even_plan(graph, 4), speed, pol.PolicyConfig(), 80)
    assert switches[0] == 5 and len(switches) == 2 and switches[1] <= 8 + 10, [(s, decisions[s].reason) for s in switches]
    layers = per_rank_layers(state.plan)
    assert layers[1] < layers[0] and layers[2] < layers[3], layers


@pytest.mark.parametrize("placement", ["straight", "loop"])
def test_a_healthy_rank_looking_15pc_slow_for_a_window_at_a_time_never_switches(placement):
    """Balanced workers on a shared machine: every 5 steps another rank reads up to 15 % slow for the whole window
    (a window-long burst, not per-sample noise), plus +-5 % per sample: 200 steps, not one switch."""
    graph = chain_graph(24)
    for seed in range(3):
        rng = random.Random(seed)
        slow = {block: (rng.randrange(4), rng.uniform(0.85, 0.9)) for block in range(200 // 5 + 1)}

        def speed(rank, step):
            who, factor = slow[step // 5]
            return factor if rank == who else 1.0

        if placement == "straight":
            switches, _, decisions = replay(graph, even_plan(graph, 4), speed, pol.PolicyConfig(), 200, noise=0.05,
                                            seed=seed)
        else:
            switches, _ = loop_replay(graph, loop_plan(graph, 4, 2), speed, pol.PolicyConfig(), 200, noise=0.05,
                                      seed=seed)
        assert switches == [], switches


def test_the_coordinator_issues_the_plan_with_the_banded_speeds_it_was_solved_for():
    """The rebalancer, fed reports as the server records them (the bench's window: rank 3 reads 15 % slow): the plan it
    sends is the clean one, and the speeds it hands to `issue` (logged by the bench, used by `--schedule auto`) are the
    banded ones it was solved for."""
    from model_parallel.coordinator.rebalancer import Rebalancer
    from model_parallel.coordinator.status import WorkerState
    from model_parallel.messages import StepReport

    graph = chain_graph(24)
    rebalancer = Rebalancer(graph, even_plan(graph, 4), pol.PolicyConfig(), default_solver, auto=True, world_size=4)
    issued, inner = [], rebalancer.issue

    def issue(plan, reason, step, send, predicted, speeds=None):
        issued.append(dict(speeds))
        return inner(plan, reason, step, send, predicted, speeds)

    rebalancer.issue = issue
    workers = {r: WorkerState(rank=r, host="h", pid=r, world_size=4) for r in range(4)}
    sent = []
    for step in range(1, 12):
        for rank in range(4):
            ms = 6 * 3.0 / BENCH_WINDOW[rank]  # 6 layers of 1 profiled ms each, on a machine 3x slower
            report = StepReport(rank, step, rebalancer.plan.version, rank, ms, ms, 0.0, 0.0, 1.0)
            workers[rank].reports.append(report)
            workers[rank].step = step
            rebalancer.on_report(workers[rank], report, workers, lambda r, c: sent.append(c) or True, False)
        if sent:
            break
    assert len(sent) == 1 and per_rank_layers(sent[0].plan) == {0: 7, 1: 3, 2: 7, 3: 7}
    assert issued == [{0: pytest.approx(0.93), 1: pytest.approx(0.47), 2: pytest.approx(0.93), 3: pytest.approx(0.93)}]

