"""The memory footprint under interleaved 1F1B (loop placement): each stage priced by the interleaved in-flight
rule over all stage positions, and the end-of-run table's row of a rank summing its stages."""
from __future__ import annotations

from dataclasses import replace

import pytest

from model_parallel.graph.in_flight import microbatches_in_flight
from model_parallel.graph.plan import Plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.observe.memory_table import Measured, MemoryReport, format_memory, predicted, rank_stages


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


def test_a_rank_row_sums_its_stages():
    graph, plan = _loop(4, 2)
    assert rank_stages(plan) == {0: (0, 2), 1: (1, 3)}
    assert rank_stages(even_plan(graph, 2).with_default_ranks()) == {0: (0,), 1: (1,)}
    parts = predicted(graph, plan, "adamw", 0.0, "interleaved", 4, 2)
    rows = [("0", Measured(0, 2e6, None, None, 5e6)), ("1", Measured(1, 1e6, None, None, 4e6))]
    groups = rank_stages(plan)
    text = format_memory(parts, rows, "rank", "peak_rss_growth", groups)
    first = next(line for line in text.splitlines() if line.split()[:2] == ["0", "0,2"])
    assert float(first.split()[2]) == pytest.approx((parts[0]["total"] + parts[2]["total"]) / 1e6, abs=1e-3)
    report = MemoryReport(parts, rows, text, groups)
    assert [(r["stages"], r["predicted_bytes"]) for r in report.stage_rows()] == [
        ((0, 2), parts[0]["total"] + parts[2]["total"]), ((1, 3), parts[1]["total"] + parts[3]["total"])]
