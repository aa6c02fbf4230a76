"""ZBV's starting plan (`optimizer.contiguous.v_plan`): 2p stages in a V balanced by each rank's two stages summed,
what a zbv job starts with (api/job.py), what `--schedule auto` prices for zbv and what `model-parallel partition
--schedule zbv` writes; under a memory cap the plan fits, or the refusal names the least memory per worker that does."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from model_parallel.api import auto_schedule
from model_parallel.api.job import JobSpec, _schedule_plan
from model_parallel.cli.partition import main as partition_main
from model_parallel.errors import ConfigError, InfeasibleError, PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.in_flight import FLUSH_SCHEDULES
from model_parallel.graph.io import load_graph
from model_parallel.graph.plan import Plan, read_plan
from model_parallel.optimizer.contiguous import v_plan
from model_parallel.optimizer.memory import Footprint, loop_rank_parts, plan_footprint
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.plancheck import check_plan
from model_parallel.runtime.step.auto import chosen_schedule
from tests.unit.optimizer.test_v_plan import brute_force, v_ranks

MB = 1e6


def weighted_chain(costs: list[float]) -> Graph:
    """Input -> n0 -> ...: layer i costs `costs[i]` ms (half forward, half backward), 1 MB of weights, 1 MB out."""
    nodes = [Node("x", "Input0", activation_size=MB)]
    nodes += [Node(f"n{i}", f"Linear({i})", forward_ms=c / 2, backward_ms=c / 2, parameter_size=MB, activation_size=MB)
              for i, c in enumerate(costs)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def slowest_rank_ms(plan: Plan, p: int) -> float:
    """The slowest rank's stages summed (ms), stage k on rank min(k, 2p-1-k)."""
    return max(sum(plan.stages[k].compute_s for k in (r, 2 * p - 1 - r)) for r in range(p)) * 1e3


def rank_bytes(graph: Graph, plan: Plan, footprint: Footprint) -> list[float]:
    merged = loop_rank_parts(plan_footprint(graph, plan, footprint), plan, footprint.microbatches, "zbv")
    return [summed["total"] for _, (_, summed) in sorted(merged.items())]


def stage_nodes(plan: Plan) -> list[tuple[str, ...]]:
    return [s.node_ids for s in plan.stages]


# An expensive layer at each end (9 ms first, 3 ms last) around ten 1 ms layers: rank 0 holds both ends. The even
# 4-stage split is pinned by the 9 ms stage and evens the other three (4, 4, 5 ms): rank 0 gets 9 + 5 = 14 ms. The V
# gives rank 0 the ends alone (9 + 3 = 12 ms) and rank 1 the whole middle (10 ms): stages 1 and 2 share rank 1.
ENDS = [9.0] + [1.0] * 10 + [3.0]


def test_the_v_start_beats_the_even_split_s_slowest_rank():
    graph = weighted_chain(ENDS)
    plan = v_plan(graph, 2)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)] and plan.v_width == 2
    assert slowest_rank_ms(plan, 2) == pytest.approx(12.0)
    assert slowest_rank_ms(even_plan(graph, 4), 2) == pytest.approx(14.0)
    assert "time per minibatch (slowest rank, its stages summed): 12.000 ms" in plan.table()
    assert plan.extra["footprint"]["schedule"] == "zbv" and all(p["in_flight"] >= 1 for p in plan.extra["memory"])
    assert check_plan(graph, plan, 2, "zbv").plan == plan


@pytest.mark.parametrize("costs", [ENDS, [2.0, 7.0, 1.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 6.0], [5.0] + [1.0] * 9 + [8.0, 1.0]])
def test_the_v_start_is_the_best_v_on_two_ranks_and_never_worse_than_the_even_split(costs):
    graph = weighted_chain(costs)
    plan, even = v_plan(graph, 2), even_plan(graph, 4)
    assert slowest_rank_ms(plan, 2) == pytest.approx(brute_force(graph, v_ranks(2), {0: 1.0, 1: 1.0}))
    assert slowest_rank_ms(plan, 2) <= slowest_rank_ms(even, 2) + 1e-9
    with pytest.raises(PlanError, match=r"zbv places 2 stages per rank in a V over p >= 2 ranks, got p=1"):
        v_plan(graph, 1)


def test_a_zbv_job_starts_on_the_v_and_auto_prices_that_v():
    graph = weighted_chain(ENDS)
    job = JobSpec(graph=graph, batch_size=8, num_microbatches=8, schedule="zbv")
    assert stage_nodes(_schedule_plan(job, graph, "zbv", None, 2)) == stage_nodes(v_plan(graph, 2))
    others = {name: "ruled out by the test" for name in FLUSH_SCHEDULES if name != "zbv"}
    auto = replace(job, schedule="auto", schedule_refusals=others)
    plan = auto_schedule.resolve_auto(graph, 2, 8, auto.micro_batch, others,
                                      lambda name: _schedule_plan(auto, graph, name, None, 2))
    assert chosen_schedule(plan) == "zbv" and stage_nodes(plan) == stage_nodes(v_plan(graph, 2))


def test_under_a_memory_cap_the_v_fits_or_the_refusal_names_the_least_that_fits(reference_profiles):
    graph = load_graph(reference_profiles / "vgg16.graph.txt")
    footprint = Footprint(schedule="zbv", microbatches=8)
    balanced = v_plan(graph, 4, footprint=footprint)
    need = max(rank_bytes(graph, balanced, footprint))
    assert stage_nodes(v_plan(graph, 4, memory_per_worker=need, footprint=footprint)) == stage_nodes(balanced)
    # 3 % less: the balanced V's fullest rank no longer fits; another V does, every rank under the cap.
    capped = v_plan(graph, 4, memory_per_worker=0.97 * need, footprint=footprint)
    assert stage_nodes(capped) != stage_nodes(balanced) and max(rank_bytes(graph, capped, footprint)) <= 0.97 * need
    assert capped.is_v_placement and "(slowest rank, its stages summed)" in capped.table()
    with pytest.raises(InfeasibleError, match=r"the balanced zbv split puts a predicted .* GB on rank \d \(stages "
                                              r"\[\d, \d\].* the least memory per worker that fits is") as refused:
        v_plan(graph, 4, memory_per_worker=0.5 * need, footprint=footprint)
    least = int(re.search(r"that fits is [0-9.]+ GB \((\d+) bytes", str(refused.value)).group(1))
    assert 0.5 * need < least <= need
    fitted = v_plan(graph, 4, memory_per_worker=least, footprint=footprint)  # the memory named fits
    assert max(rank_bytes(graph, fitted, footprint)) <= least


def test_partition_command_line_writes_the_v(tmp_path, capsys, reference_profiles):
    profile = str(reference_profiles / "vgg16.graph.txt")
    assert partition_main(["-f", profile, "-n", "4", "--schedule", "zbv", "--microbatches", "8", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ZBV: 8 stages on 4 workers in a V (worker r holds stages r and 7-r)" in out and "worker 0: stages 0,7" in out
    assert "time per minibatch (slowest rank, its stages summed)" in out
    # The workers' sums are the table's minibatch times (the profile's batch), not a microbatch's.
    assert re.search(r"worker 0: stages 0,7, compute [0-9.]+ ms per (minibatch of \d+ samples \(the profile's\)|"
                     r"profiled minibatch)\n", out) and "per microbatch" not in out
    plan = read_plan(tmp_path / "plan.json")
    assert plan.is_v_placement and stage_nodes(plan) == stage_nodes(v_plan(load_graph(profile), 4))
    with pytest.raises(ConfigError, match="--schedule zbv plans a V balanced by rank sums .*--stages_per_rank do not"):
        partition_main(["-f", profile, "-n", "4", "--schedule", "zbv", "--stages_per_rank", "3"])
