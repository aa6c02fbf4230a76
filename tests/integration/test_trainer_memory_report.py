"""`PipelineTrainer.train` ends with the worker command line's memory table (runtime/observe/memory_table.py):
one row per stage, predicted bytes next to measured bytes, logged on rank 0 and kept as `trainer.memory_report`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import free_port, launch
from support.eval_cases import make_case

WORKER = Path(__file__).parents[1] / "support" / "memory_report_worker.py"


@pytest.mark.slow
def test_two_process_trainer_reports_predicted_and_measured_memory_per_stage(tmp_path):
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), "2", str(port), str(tmp_path)] for rank in range(2)],
                    timeout=300)
    assert result.ok, result.summary()
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports[0] == reports[1], "every rank keeps the same gathered report"
    rows = reports[0]["rows"]
    assert [row["stage"] for row in rows] == [0, 1]
    for row in rows:
        assert row["predicted_bytes"] > 0 and row["measured_bytes"] > 0, row
        # Parameters + gradients + momentum are counted exactly on both sides; activations are the rest.
        assert 0.8 < row["predicted_bytes"] / row["measured_bytes"] < 1.25, row
    assert "predicted MB" in reports[0]["text"] and "measured MB" in reports[0]["text"]
    assert "memory per stage, predicted vs measured" in result.output(0)  # logged at INFO on rank 0 only
    assert "memory per stage" not in result.output(1)


def test_single_process_trainer_reports_the_prediction_per_stage():
    from model_parallel import PipelineTrainer

    case = make_case("mlp")
    trainer = PipelineTrainer(case.model, case.sgd, case.train_data, case.config, criterion=case.loss, num_stages=2,
                              example_inputs=case.example, single_process=True)
    trainer.train(1)
    rows = trainer.memory_report.stage_rows()
    assert [row["stage"] for row in rows] == [0, 1]
    assert all(row["predicted_bytes"] > 0 and row["measured_bytes"] is None for row in rows)
    assert "n/a" in trainer.memory_report.text
