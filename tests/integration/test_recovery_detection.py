"""A survivor that is not next to the lost rank learns of the failure from its neighbour, not from its own
--timeout: the neighbour that diagnosed the loss closes its gloo connections before it leaves the broken world
(runtime/wire/recovery.close_connections), so a receive still pending on it fails at once ("Connection closed by
peer") instead of timing out ("Timed out waiting ..."). 3 ranks in a line, 0 -> 1 -> 2; original rank 2 is killed
as its step 5 begins, when rank 0 waits on rank 1. --timeout 20 leaves a wide margin: without the closing, rank 0's
receive times out; with it, nothing does. The run stays exact."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import launch_workers
from support.mlp import assert_params_close, reference_params

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
STEPS = 10


def test_the_survivor_away_from_the_lost_rank_is_told_by_its_neighbour_not_by_its_timeout(tmp_path: Path) -> None:
    args = ["--model", "mlp", "--steps", str(STEPS), "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01",
            "--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "2", "--timeout", "20", "--recover"]
    result = launch_workers(args, 3, timeout=180, env={"MP_TEST_SIGNAL_AT_STEP": "2:5:KILL"})
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 0, -signal.SIGKILL], result.summary()
    for rank in (0, 1):
        output = result.output(rank)
        [found] = [line for line in output.splitlines() if "recovering (--recover)" in line]
        assert "rank 2 stopped responding" in found, found
        assert "Timed out waiting" not in found and "timed out after" not in found, found
        assert "recovery 1: lost original rank(s) [2]; new world of 2 (original ranks [0, 1]" in output, output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "recovered run")
