"""PipelineTrainer on ranks whose graphs carry different timings (each rank profiled on its own) under a zero-bubble
schedule: rank 0's stage times travel with its plan, so every rank list-builds the same order and the job runs (it
was refused by the same-job check, "another stage times than rank 0")."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import free_port, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).parents[1] / "support" / "list_order_trainer_worker.py"


def test_ranks_with_their_own_profiles_build_rank_0s_order(tmp_path: Path) -> None:
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), "2", str(port), str(tmp_path)] for rank in range(2)],
                    timeout=240)
    assert result.ok, result.summary()
    times = [json.loads((tmp_path / f"rank{rank}.json").read_text())["times"] for rank in range(2)]
    assert times[0] and times[0] == times[1]  # rank 0's (its profile's scale 1.0), on both ranks
