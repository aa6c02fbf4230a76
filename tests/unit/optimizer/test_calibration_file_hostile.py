"""A calibration JSON file (`model-parallel calibrate --out`, read by the demo's report) that is not what calibrate
writes is one PlanError naming the file - a list, a curve of non-pairs or a nesting 10^5 deep were a TypeError,
a ValueError or a RecursionError traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_parallel.errors import PlanError
from model_parallel.optimizer.fidelity import Calibration

HOSTILE = {
    "a list": "[1, 2]",
    "a number": "7",
    "a curve of non-pairs": json.dumps({"accumulate_curve": [[1, 2, 3]]}),
    "a curve of strings": json.dumps({"accumulate_curve": [["a", "b"]]}),
    "optimizer times a list": json.dumps({"optimizer_ms_per_mb": [1.0]}),
    "machine a string": json.dumps({"machine": "x"}),
    "a negative overhead": json.dumps({"microbatch_overhead_ms": -1}),
    "nested 100000 deep": "[" * 100_000 + "]" * 100_000,
    "1e999": '{"link_latency_ms": 1e999}',
    "NaN": '{"link_latency_ms": NaN}',
    "not JSON": "{",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_calibration_file_is_a_plan_error_naming_it(name: str, tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(HOSTILE[name])
    with pytest.raises(PlanError, match="calibration.json"):
        Calibration.read(path)


def test_a_calibration_reads_back(tmp_path: Path) -> None:
    calibration = Calibration(microbatch_overhead_ms=0.5, optimizer_ms_per_mb={"sgd": 0.1},
                              accumulate_curve=((1024.0, 0.2), (4096.0, 0.3)), clock="cpu")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration.to_json()))
    assert Calibration.read(path) == calibration
