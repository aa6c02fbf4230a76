"""The machine measurements of cli/calibrate.py that feed optimizer/fidelity.py's new terms."""
from __future__ import annotations

import math
import multiprocessing
import sys

import pytest

from model_parallel.cli.calibrate import CURVE_WIDTHS, accumulate_curve, combine
from model_parallel.cli.timeshare import timeshare_factor
from model_parallel.optimizer.fidelity import Calibration


def _rank(curve: list[list[float]]) -> dict:
    return {"latency_ms": 0.1, "bandwidth": 1e9, "overhead_ms": 0.5, "optimizer_ms_per_mb": {"sgd": 0.2, "adamw": 1.0},
            "accumulate_ms_per_mb": 0.1, "clock": "cpu", "accumulate_curve": curve}


def test_combine_keeps_the_faster_ranks_accumulation_per_size():
    calibration = combine([_rank([[1e6, 0.1], [4e6, 0.5]]), _rank([[1e6, 0.2], [4e6, 0.3]])])
    assert calibration.accumulate_curve == ((1e6, 0.1), (4e6, 0.3))
    assert calibration.corun_factor == 1.0  # rank files without the co-running measurement
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


def test_combine_takes_the_ranks_median_co_running_factor_and_never_below_one():
    ranks = [_rank([[1e6, 0.1]]) | {"corun_factor": 1.3}, _rank([[1e6, 0.1]]) | {"corun_factor": 1.1}]
    assert combine(ranks).corun_factor == pytest.approx(1.2)
    faster = [_rank([[1e6, 0.1]]) | {"corun_factor": 0.97}, _rank([[1e6, 0.1]]) | {"corun_factor": 0.99}]
    assert combine(faster).corun_factor == 1.0  # timing noise, not a speed-up from company


CORUN_RANK = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from model_parallel.cli.calibrate import corun_factor
torch.set_num_threads(1)
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
print("corun", corun_factor(rank, 2, phases=2, pairs=3), flush=True)
dist.destroy_process_group()
"""


def test_corun_factor_is_measured_by_every_rank_of_a_world_together():
    from model_parallel.runtime.launch import free_port, launch

    port = str(free_port())
    result = launch([[sys.executable, "-c", CORUN_RANK, str(rank), port] for rank in range(2)], timeout=120.0)
    assert result.ok, result.summary()
    factors = [float(line.split()[1]) for worker in result.workers for line in worker.output.splitlines()
               if line.startswith("corun ")]
    assert len(factors) == 2 and all(math.isfinite(f) and f > 0 for f in factors)
