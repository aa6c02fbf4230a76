"""The optimizer's interleaved plan (`optimizer.contiguous.loop_plan`, `model-parallel partition --schedule
interleaved`): p*v stages balanced by profiled cost, stage k on worker k % p, priced by the interleaved footprint;
under a memory cap a rank's stages must fit together (`MemoryLimit` sums them under loop placement)."""
from __future__ import annotations

import json

import pytest

from model_parallel.cli.partition import main as partition_main
from model_parallel.errors import ConfigError, InfeasibleError, PlanError
from model_parallel.graph.io import load_graph
from model_parallel.graph.plan import read_plan
from model_parallel.optimizer.contiguous import loop_plan
from model_parallel.optimizer.memory import Footprint, MemoryLimit, loop_rank_parts, plan_footprint
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.plancheck import check_plan


def _rank_bytes(graph, plan, footprint) -> list[float]:
    merged = loop_rank_parts(plan_footprint(graph, plan, footprint), plan, footprint.microbatches, footprint.schedule)
    return [summed["total"] for _, (_, summed) in sorted(merged.items())]


def test_balanced_loop_plan_is_the_even_split_in_a_loop(reference_profiles):
    graph = load_graph(reference_profiles / "resnet50.graph.txt")
    plan = loop_plan(graph, 4, 2)
    assert plan.loop_width == 4 and [s.ranks for s in plan.stages] == [(k % 4,) for k in range(8)]
    times = [sum(plan.stages[k].compute_s for k in plan.stages_of_rank(r)) for r in range(4)]
    assert max(times) / min(times) < 1.1  # balanced by profiled cost
    # Balanced by rank sums (optimizer/loop.py): never slower than the even 8-stage split laid in a loop.
    even = even_plan(graph, 8)
    assert max(times) <= max(sum(even.stages[k].compute_s for k in (r, r + 4)) for r in range(4)) * (1 + 1e-9)
    assert check_plan(graph, plan, 4, "interleaved").plan == plan
    assert plan.extra["footprint"]["schedule"] == "interleaved" and all(p["in_flight"] >= 1 for p in plan.extra["memory"])


def test_a_memory_cap_bounds_each_rank_sum(reference_profiles):
    graph = load_graph(reference_profiles / "gnmt.graph.txt")
    footprint = Footprint(schedule="interleaved", microbatches=8)
    balanced = loop_plan(graph, 2, 2, footprint=footprint)
    need = max(_rank_bytes(graph, balanced, footprint))
    assert loop_plan(graph, 2, 2, memory_per_worker=need, footprint=footprint).stages == balanced.stages
    # 3 % less: the balanced split's rank 1 no longer fits; a split with a smaller stage there does.
    capped = loop_plan(graph, 2, 2, memory_per_worker=0.97 * need, footprint=footprint)
    assert capped.stages != balanced.stages and max(_rank_bytes(graph, capped, footprint)) <= 0.97 * need
    with pytest.raises(InfeasibleError, match=r"puts a predicted .* GB on rank 0 \(stages \[0, 2\]: parameters"):
        MemoryLimit(need * 0.5, footprint).check(graph, balanced)
    with pytest.raises(InfeasibleError, match="No split whose every stage fits 1/2 of it"):
        loop_plan(graph, 2, 2, memory_per_worker=0.2 * need, footprint=footprint)
    with pytest.raises(PlanError, match="needs p >= 2 ranks with v >= 2 stages each"):
        loop_plan(graph, 4, 1)


def test_partition_command_line_writes_a_loop_plan(tmp_path, capsys, reference_profiles):
    profile = str(reference_profiles / "resnet50.graph.txt")
    assert partition_main(["-f", profile, "-n", "4", "--schedule", "interleaved", "--microbatches", "8",
                           "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Interleaved 1F1B: 8 stages on 4 workers" in out and "worker 3: stages 3,7" in out
    assert "analytic bubble at m=8: 15.8% (1F1B: 27.3%)" in out
    plan = read_plan(tmp_path / "plan.json")
    assert plan.loop_width == 4 and json.loads((tmp_path / "plan.json").read_text())["extra"]["schedule"] == "interleaved"
    with pytest.raises(InfeasibleError, match="on rank 0"):
        partition_main(["-f", profile, "-n", "4", "--schedule", "interleaved", "--memory_per_worker", "1e9"])
    with pytest.raises(ConfigError, match="--search, --use_fewer_machines do not apply to it"):
        partition_main(["-f", profile, "-n", "4", "--schedule", "interleaved", "--search", "--use_fewer_machines"])


def test_zbinterleaved_is_priced_by_its_own_footprint(tmp_path, capsys, reference_profiles):
    """zbinterleaved keeps each microbatch until its W: a cap the interleaved split fits must be checked against
    zbinterleaved's larger footprint, not interleaved's (a plan priced as interleaved could run out of memory)."""
    graph = load_graph(reference_profiles / "gnmt.graph.txt")
    interleaved, zero_bubble = (Footprint(schedule=s, microbatches=8) for s in ("interleaved", "zbinterleaved"))
    balanced = loop_plan(graph, 2, 2, footprint=interleaved)
    need = max(_rank_bytes(graph, balanced, interleaved))
    assert max(_rank_bytes(graph, balanced, zero_bubble)) > need  # the premise: zero bubble holds more
    with pytest.raises(InfeasibleError, match="the balanced zbinterleaved split puts a predicted"):
        loop_plan(graph, 2, 2, memory_per_worker=need, footprint=zero_bubble, schedule="zbinterleaved")
    enough = max(_rank_bytes(graph, balanced, zero_bubble))
    fits = loop_plan(graph, 2, 2, memory_per_worker=enough, footprint=zero_bubble, schedule="zbinterleaved")
    assert fits.extra["footprint"]["schedule"] == "zbinterleaved"
    assert [s.node_ids for s in fits.stages] == [s.node_ids for s in balanced.stages]
    with pytest.raises(PlanError, match="a loop plan is for interleaved or zbinterleaved"):
        loop_plan(graph, 2, 2, schedule="zbv")
    profile = str(reference_profiles / "resnet50.graph.txt")
    assert partition_main(["-f", profile, "-n", "4", "--schedule", "zbinterleaved", "--microbatches", "8",
                           "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Interleaved zero bubble: 8 stages on 4 workers" in out and "--schedule zbinterleaved --plan plan.json" in out
    assert json.loads((tmp_path / "plan.json").read_text())["extra"]["footprint"]["schedule"] == "zbinterleaved"
