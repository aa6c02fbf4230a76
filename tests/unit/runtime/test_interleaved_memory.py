"""The memory footprint under interleaved 1F1B (loop placement): each stage priced by the interleaved in-flight
rule over all stage positions, and a rank's row: its stages' weights summed, its activations at the peak of its
order (optimizer.memory.loop_rank_parts, graph/in_flight.interleaved_peak)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from model_parallel.graph.in_flight import interleaved_in_flight, interleaved_peak, microbatches_in_flight
from model_parallel.graph.plan import Plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.optimizer.memory import loop_rank_parts
from model_parallel.runtime.observe.memory_table import Measured, MemoryReport, format_memory, predicted


def _loop(stages: int, ranks: int) -> tuple[object, Plan]:
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    plan = even_plan(graph, stages)
    return graph, replace(plan, stages=tuple(replace(s, ranks=(s.stage_id % ranks,)) for s in plan.stages))


@pytest.mark.parametrize("stages, ranks, m", [(4, 2, 4), (6, 2, 2), (8, 4, 8)])
def test_every_stage_is_priced_by_its_position_among_all_stages(stages, ranks, m):
    graph, plan = _loop(stages, ranks)
    parts = predicted(graph, plan, "sgd", 0.9, "interleaved", m, 2)
    flights = [p["in_flight"] for p in parts]
    assert flights == [microbatches_in_flight("interleaved", m, stages, k) for k in range(stages)]
    assert all(f >= 1 for f in flights) and all(p["activations"] >= 0 for p in parts)


def test_a_rank_row_holds_its_stages_at_the_peak_of_its_order():
    graph, plan = _loop(4, 2)
    parts = predicted(graph, plan, "adamw", 0.0, "interleaved", 4, 2)
    merged = loop_rank_parts(parts, plan, 4)
    assert sorted(merged) == [0, 1] and merged[0][0] == (0, 2) and merged[1][0] == (1, 3)
    held, rank0 = merged[0]
    assert rank0["parameters"] == parts[0]["parameters"] + parts[2]["parameters"]
    # Rank 0 of p = 2, v = 2, m = 4 runs 0F0 0F1 2F0 2F1 0F2 before its first backward: 3 microbatches of
    # stage 0 and 2 of stage 2 at its peak (5 pairs: in_flight.interleaved_in_flight), fewer than each stage's
    # own bound added up (4 + 4).
    per = [parts[k]["activations"] / parts[k]["in_flight"] for k in held]
    assert interleaved_in_flight(4, 2, 2, 0) == 5
    assert rank0["activations"] == pytest.approx(3 * per[0] + 2 * per[1])
    assert rank0["activations"] < parts[0]["activations"] + parts[2]["activations"]
    assert rank0["total"] == pytest.approx(parts[0]["total"] + parts[2]["total"] - parts[0]["activations"]
                                           - parts[2]["activations"] + rank0["activations"])
    rows = [("0", Measured(0, 2e6, None, None, 5e6)), ("1", Measured(1, 1e6, None, None, 4e6))]
    text = format_memory(parts, rows, "rank", "peak_rss_growth", merged)
    first = next(line for line in text.splitlines() if line.split()[:2] == ["0", "0,2"])
    assert float(first.split()[2]) == pytest.approx(rank0["total"] / 1e6, abs=1e-3)
    report = MemoryReport(parts, rows, text, merged)
    assert [(r["stages"], r["predicted_bytes"]) for r in report.stage_rows()] == [
        ((0, 2), rank0["total"]), ((1, 3), merged[1][1]["total"])]


def test_the_peak_walks_the_rank_order():
    # p = 2, v = 2, m = 2, rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 (interleaved.py's grid): all four held at once
    assert interleaved_peak(2, 2, 0, [1.0, 10.0]) == 22.0
    # rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1: at most 2 of stage 1 and 1 of stage 3
    assert interleaved_peak(2, 2, 1, [1.0, 10.0]) == 12.0
    assert interleaved_peak(2, 2, 1, [1.0, 10.0], replica=1, replicas=2) == 11.0  # microbatch 1 only


@pytest.mark.parametrize("m", [2, 4, 8])
def test_a_v_prices_every_stage_by_its_position_and_a_rank_row_sums_its_two_stages(m):
    """zbv (rank r holds stages r and 2p-1-r): stage k at position k of the 2p (stages past p once priced at a
    negative count, by ranks), and a rank's row is its two stages summed (an upper bound of its peak)."""
    r = recipe("gpt")
    graph, _ = trace_model(r.model(0), r.example(2))
    four = even_plan(graph, 4)
    plan = replace(four, stages=tuple(replace(s, ranks=((0, 1, 1, 0)[s.stage_id],)) for s in four.stages))
    parts = predicted(graph, plan, "sgd", 0.9, "zbv", m, 2)
    assert [p["in_flight"] for p in parts] == [min(4 - k, m) for k in range(4)]
    assert all(p["activations"] > 0 for p in parts)
    merged = loop_rank_parts(parts, plan, m)
    assert sorted(merged) == [0, 1] and merged[0][0] == (0, 3) and merged[1][0] == (1, 2)
    for first, (held, summed) in merged.items():
        assert summed["total"] == pytest.approx(sum(parts[k]["total"] for k in held))
        assert summed["activations"] == pytest.approx(sum(parts[k]["activations"] for k in held))
