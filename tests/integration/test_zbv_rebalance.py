"""The auto policy under ZBV on 2 processes: a V (4 stages; rank 0 holds stages 0 and 3, rank 1 stages 1 and 2),
rank 1 slowed 4x after step 2; the coordinator proposes a V that moves work off it (each rank priced by its summed
stages, optimizer/loop.py `v_rank_plan`), the workers switch live, and training equals single-process training
within 1e-5; under `--schedule auto` too. The loop (interleaved): test_interleaved_rebalance.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from support.mlp import assert_params_close, reference_params
from support.slowed_worlds import run_slowed


@pytest.mark.slow  # starts a coordinator and workers
@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", ["zbv", "auto"])
def test_zbv_auto_rebalances_a_slowed_rank_live_and_stays_exact(tmp_path: Path, schedule: str) -> None:
    """`auto`: the V given runs only under zbv, so the workers choose it, and the coordinator chooses it again for
    each V it issues (coordinator/rechoose.py)."""
    run = run_slowed(tmp_path, schedule, lambda k: min(k, 3 - k), steps=40)
    out = run.coordinator_output
    assert "plan v1 is live" in out and "auto: predicted" in out, out
    if schedule == "auto":
        assert "schedule auto after plan v1: chose zbv" in out, out
        assert run.checkpoint.extra["training"]["schedule_running"] == "zbv"
    assert run.live["version"] >= 1 and [s["ranks"] for s in run.live["stages"]] == [[0], [1], [1], [0]]
    before, after = run.layers_on(1)
    assert after < before, run.live  # work moved off the slowed rank, still in a V
    assert_params_close(run.checkpoint.params(), reference_params(40), f"{schedule}, rebalanced live")
