"""`--offload_optimizer DIR` / `--offload_chunk_mb` on the worker reach RunOptions and the footprint the plan is priced by."""
from __future__ import annotations

import pytest

from model_parallel.cli.worker import build_parser
from model_parallel.cli.worker_job import job_spec, make_config
from model_parallel.errors import ConfigError


def test_the_flags_reach_run_options_and_the_job_spec(tmp_path):
    args = build_parser().parse_args(["--model", "mlp", "--optimizer", "adamw", "--memory_per_worker", "1e9",
                                      "--offload_optimizer", str(tmp_path), "--offload_chunk_mb", "8"])
    _, options = make_config(args)
    assert options.offload_optimizer == str(tmp_path) and options.offload_chunk_bytes == 8_000_000
    assert job_spec(args).offload_chunk == 8e6
    plain = build_parser().parse_args(["--model", "mlp", "--offload_chunk_mb", "8"])
    assert make_config(plain)[1].offload_chunk_bytes is None and job_spec(plain).offload_chunk is None


def test_a_chunk_of_nothing_is_refused(tmp_path):
    args = build_parser().parse_args(["--model", "mlp", "--offload_optimizer", str(tmp_path), "--offload_chunk_mb", "0"])
    with pytest.raises(ConfigError, match="offload_chunk_mb must be > 0"):
        make_config(args)
