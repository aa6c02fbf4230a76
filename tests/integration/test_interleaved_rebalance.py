"""The auto policy under interleaved 1F1B on 2 processes: a loop plan (4 stages, 2 per rank), rank 1 slowed 4x after
step 2; the coordinator proposes a loop plan that moves work off it (each rank priced by its summed stages), the
workers switch live, and training equals single-process training within 1e-5. The V (zbv): test_zbv_rebalance.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from support.mlp import assert_params_close, reference_params
from support.slowed_worlds import run_slowed


@pytest.mark.slow  # starts a coordinator and workers
@pytest.mark.timeout(400)
def test_interleaved_auto_rebalances_a_slowed_rank_live_and_stays_exact(tmp_path: Path) -> None:
    run = run_slowed(tmp_path, "interleaved", lambda k: k % 2, steps=40)
    assert "plan v1 is live" in run.coordinator_output and "auto: predicted" in run.coordinator_output, \
        run.coordinator_output
    assert run.live["version"] >= 1 and [s["ranks"] for s in run.live["stages"]] == [[k % 2] for k in range(4)]
    before, after = run.layers_on(1)
    assert after < before, run.live  # work moved off the slowed rank, still in a loop
    assert_params_close(run.checkpoint.params(), reference_params(40), "interleaved, rebalanced live")
