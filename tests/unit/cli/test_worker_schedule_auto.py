"""The worker command line's `--schedule auto`: the flags that rule a schedule out reach the job builder."""
from __future__ import annotations

import torch

from model_parallel.cli.worker import build_parser
from model_parallel.cli.worker_job import job_spec


def test_flags_that_interleaved_cannot_honour_are_refusals_in_the_job_spec() -> None:
    def refusals(*flags: str, device: torch.device = torch.device("cpu")) -> dict[str, str]:
        args = build_parser().parse_args(["--model", "mlp", "--schedule", "auto", *flags])
        spec = job_spec(args, device=device)
        assert spec.schedule == "auto"
        return dict(spec.schedule_refusals or {})

    assert refusals() == {}
    assert refusals("--bf16", "--recompute", "all") == {}  # every schedule runs them
    assert refusals("--measure_memory") == {}  # every schedule measures a rank's stages in one meter
    assert refusals("--coordinator", "127.0.0.1:1") == {}  # the policy re-plans every placement: a loop and a V too
    assert "NCCL ignores" in refusals(device=torch.device("cuda", 0))["interleaved"]
