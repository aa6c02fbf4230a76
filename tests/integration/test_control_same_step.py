"""A command from --control_script rides in the step's one reduction (runtime/wire/step_totals.py) and is
still applied by every rank at the same step boundary: the scripted step, exactly, with the run exact."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_parallel.graph.plan import Plan, StagePlan, read_plan
from model_parallel.messages import Command
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.observe.metrics_read import read_metrics
from support.mlp import assert_params_close, mlp_job, reference_params

EXIT_STOPPED = 4  # cli/worker_exit.py: stopped before the requested steps
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_scripted_switch_and_stop_land_on_every_rank_at_the_scripted_step(tmp_path: Path) -> None:
    graph_path, plan_path = mlp_job(tmp_path, 3)
    three = read_plan(plan_path)
    # Before step 2: onto 2 stages on ranks 1 and 2 (rank 0 becomes a spare); before step 4: stop.
    nodes = [n for s in three.stages for n in s.node_ids]
    cut = len(three.stages[0].node_ids) + len(three.stages[1].node_ids)
    two = Plan(stages=(StagePlan(0, tuple(nodes[:cut]), ranks=(1,)), StagePlan(1, tuple(nodes[cut:]), ranks=(2,))),
               version=1)
    script = tmp_path / "control.json"
    script.write_text(json.dumps({"2": Command.switch(two, "test: onto 2 ranks").to_dict(),
                                  "4": {"kind": "stop", "reason": "test: stop at 4"}}), encoding="utf-8")
    result = launch_workers(["--graph", str(graph_path), "--plan", str(plan_path), "--steps", "7",
                             "--control_script", str(script), "--checkpoint_dir", str(tmp_path / "ck"),
                             "--metrics", str(tmp_path / "metrics" / "rank{rank}.jsonl"),
                             "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01", "--timeout", "30"],
                            3, timeout=180)
    assert [w.returncode for w in result.workers] == [EXIT_STOPPED] * 3, result.summary()
    for rank in range(3):
        records = read_metrics(tmp_path / "metrics" / f"rank{rank}.jsonl")
        # Every rank ran steps 0-3, switched before step 2 and stopped before step 4: the scripted boundaries.
        assert [(r["step"], r["plan_version"]) for r in records] == [(0, 0), (1, 0), (2, 1), (3, 1)], (rank, records)
        # Each command's JSON followed the reduction of the step before its boundary, and only then.
        assert [r["control_ms"] > 0 for r in records] == [False, True, False, True], (rank, records)
        assert "stopped after 4 of the 7 requested step(s): test: stop at 4" in result.output(rank), result.output(rank)
    checkpoint = load_checkpoint(tmp_path / "ck")  # the stop wrote one, after step 3
    assert checkpoint.extra["next_step"] == 4
    assert_params_close(checkpoint.params(), reference_params(4), "run with a scripted switch and stop")
