"""The machine measurements of cli/calibrate.py that feed optimizer/fidelity.py's new terms."""
from __future__ import annotations

import math
import multiprocessing

from model_parallel.cli.calibrate import CURVE_WIDTHS, accumulate_curve, combine, timeshare_factor
from model_parallel.optimizer.fidelity import Calibration


def _rank(curve: list[list[float]]) -> dict:
    return {"latency_ms": 0.1, "bandwidth": 1e9, "overhead_ms": 0.5, "optimizer_ms_per_mb": {"sgd": 0.2, "adamw": 1.0},
            "accumulate_ms_per_mb": 0.1, "clock": "cpu", "accumulate_curve": curve}


def test_combine_keeps_the_faster_ranks_accumulation_per_size():
    calibration = combine([_rank([[1e6, 0.1], [4e6, 0.5]]), _rank([[1e6, 0.2], [4e6, 0.3]])])
    assert calibration.accumulate_curve == ((1e6, 0.1), (4e6, 0.3))
    assert calibration.timeshare_factor == 1.0  # measured afterwards by the main process (calibrate)
    assert Calibration.from_json(calibration.to_json()) == calibration


def test_accumulate_curve_has_one_point_per_tensor_size():
    curve = accumulate_curve(reps=2, clock="cpu", megabytes=2.0)
    assert [size for size, _ in curve] == [float(w * w * 4) for w in CURVE_WIDTHS]
    assert all(math.isfinite(rate) and rate >= 0 for _, rate in curve)
    Calibration(accumulate_curve=curve)  # a valid calibration field


def test_timeshare_ring_measures_and_reaps_its_processes():
    factor = timeshare_factor(cores=1, rounds=3, timeout=120.0)  # a ring of 2 processes passing 1 token
    assert math.isfinite(factor) and factor >= 1.0
    assert multiprocessing.active_children() == []
