"""A zero-bubble order list-built from the plan's stage times (runtime/step/list_order.py) on a 4-process world: the
order differs from torch's, and training equals single-process training within 1e-5 and the fixed order's run
bitwise (gradients accumulate per stage in microbatch order whatever the order across stages)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from integration.test_runtime import _assert_close, _reference
from model_parallel.api.job import JobSpec, build_job
from model_parallel.graph.plan import write_plan
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.step.auto import run_order_times
from model_parallel.runtime.step.interleaved import run_schedule
from model_parallel.runtime.step.list_order import timed_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORLD, STAGES, M, BATCH, STEPS = 4, 8, 8, 16, 3
# bench/schedules.py's straggler plan: [4, 1, 3, 3, 3, 2, 4, 4] layers of 8 ms (F = I = W), rank 1 twice as slow
STAGE_TIMES = [[8.0 * n * (2 if k % WORLD == 1 else 1)] * 3 for k, n in enumerate([4, 1, 3, 3, 3, 2, 4, 4])]
FLAGS = ["--schedule", "zbinterleaved", "--num_microbatches", str(M), "--batch_size", str(BATCH)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("list_order")
    job = build_job(JobSpec(model="mlp", schedule="zbinterleaved", num_microbatches=M, batch_size=BATCH), WORLD)
    plan = replace(job.plan, extra={**dict(job.plan.extra), "stage_times": STAGE_TIMES})
    assert plan.num_stages == STAGES and plan.loop_width == WORLD
    # The grid every rank builds (the engine's own functions): list-built, and not torch's order.
    config = TrainConfig(batch_size=BATCH, num_microbatches=M, schedule="zbinterleaved")
    base = run_schedule("zbinterleaved", STAGES, M, WORLD)
    built = timed_schedule(base, run_order_times(job.graph, plan, config))
    assert built.order == "list" and built.grid != base.grid
    assert [built.row_actions(r) for r in range(WORLD)] != [base.row_actions(r) for r in range(WORLD)]
    write_plan(plan, root / "plan.json")
    argv = [["--model", "mlp", "--plan", str(root / "plan.json"), "--steps", str(STEPS), "--timeout", "60",
             "--checkpoint_dir", str(root / order), "--schedule_order", order, *FLAGS] for order in ("list", "fixed")]
    (root / "jobs.json").write_text(json.dumps(argv))
    result = launch_workers(["--jobs", str(root / "jobs.json"), "--timeout", "60"], WORLD, timeout=600)
    assert result.ok, result.summary()
    return root


def test_the_list_order_trains_like_one_process_and_like_the_fixed_order(runs: Path) -> None:
    listed, fixed = load_checkpoint(runs / "list"), load_checkpoint(runs / "fixed")
    assert listed.extra["next_step"] == fixed.extra["next_step"] == STEPS
    want = _reference({"model": "mlp", "steps": STEPS, "extra": FLAGS})
    _assert_close("list order", listed.params(), want)
    got, same = listed.params(), fixed.params()
    assert sorted(got) == sorted(same)
    assert all(torch.equal(got[name], same[name]) for name in got), "the list order changed a parameter's bits"
