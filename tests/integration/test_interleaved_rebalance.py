"""The auto policy under interleaved 1F1B on 2 processes: a loop plan (4 stages, 2 per rank), rank 1 slowed 4x after
step 2; the coordinator proposes a loop plan that moves work off it (each rank priced by its summed stages), the
workers switch live, and training equals single-process training within 1e-5."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from model_parallel.graph.plan import read_plan
from model_parallel.runtime.checkpoint.store import load_checkpoint
from support.mlp import assert_params_close, mlp_job, reference_params


@pytest.mark.slow  # starts a coordinator and workers
@pytest.mark.timeout(400)
def test_interleaved_auto_rebalances_a_slowed_rank_live_and_stays_exact(tmp_path: Path) -> None:
    from model_parallel.coordinator.local import CoordinatorProcess
    from model_parallel.runtime.launch import LocalWorld, worker_commands

    graph, plan = mlp_job(tmp_path, 4)
    four = read_plan(plan)
    plan.write_text(json.dumps(replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,))
                                                          for s in four.stages)).to_dict()))
    steps, token = 40, "interleaved-rebalance-token"
    with CoordinatorProcess(graph, plan, token, workdir=tmp_path,
                            extra=["--window", "3", "--cooldown-steps", "3", "--threshold", "0.05",
                                   "--schedule", "interleaved"]) as coord:
        args = ["--model", "mlp", "--plan", str(plan), "--schedule", "interleaved", "--steps", str(steps),
                "--batch_size", "8", "--num_microbatches", "4", "--checkpoint_dir", str(tmp_path / "ck"),
                "--timeout", "30", "--coordinator", coord.address, "--token", token,
                "--slowdown", "4", "--slowdown_rank", "1", "--slowdown_after_step", "2"]
        with LocalWorld(worker_commands(args, 2)) as world:
            result = world.wait(timeout=300)
        assert result.ok, result.summary()
        assert coord.wait(timeout=20) == 0, coord.output()
    out = coord.output()
    assert "plan v1 is live" in out and "auto: predicted" in out, out
    checkpoint = load_checkpoint(tmp_path / "ck")
    live = checkpoint.world["plan"]
    assert live["version"] >= 1 and [s["ranks"] for s in live["stages"]] == [[k % 2] for k in range(4)]
    before = sum(len(s.node_ids) for s in four.stages if s.stage_id % 2 == 1)
    after = sum(len(s["node_ids"]) for s in live["stages"] if s["ranks"] == [1])
    assert after < before, live  # work moved off the slowed rank, still in a loop
    assert_params_close(checkpoint.params(), reference_params(steps), "interleaved, rebalanced live")
