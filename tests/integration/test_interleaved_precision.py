"""Interleaved 1F1B with the per-stage features: activation recomputation, bf16 autocast and replicas, on 2 and 4
processes (2 or 3 stages per rank, loop placement), each job against single-process training of the same stages
with the same data, microbatching, recomputation and autocast (SingleProcessRunner rounds at the same cuts: the
plan each job ran, the default split being the optimizer's loop plan balanced by rank),
every parameter within 1e-5 relative. One world per size runs all its jobs (`--jobs`). A replicated job runs
two copies of a 2-rank pipeline (replica i of stage k on rank k % 2 + 2i: microbatch j on replica j % 2) whose
ranks all-reduce their stages' gradients."""
from __future__ import annotations

import json

import pytest
import torch

from model_parallel.graph.plan import Plan
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import launch_workers
from support import assert_relatively_close
from support.multi_stage_jobs import job_argv, reference_params

TOL = 1e-5
STEPS = 3


def _job(name: str, model: str, world: int, stages: int, *, bf16: bool = False, recompute: bool = False,
         adamw: bool = False, replicas: int = 1, extra: tuple[str, ...] = ()) -> dict:
    return {"name": name, "model": model, "world": world, "stages": stages, "bf16": bf16, "recompute": recompute,
            "adamw": adamw, "replicas": replicas, "extra": list(extra)}


JOBS = [
    _job("mlp_p2_bf16", "mlp", 2, 4, bf16=True),
    # Under a memory cap the default split is the optimizer's loop plan (a rank's stages fit together): 1 GB
    # holds the balanced split (each rank's summed stages, optimizer/loop.py), which the oracle cuts too.
    _job("mlp_p2_memory_cap", "mlp", 2, 4, extra=("--memory_per_worker", "1e9")),
    _job("gpt_p2_recompute_adamw", "gpt", 2, 4, recompute=True, adamw=True),
    # --measure_memory: one StashMeter per rank over its stages (multi_stage.LaneMeter), in the memory table
    _job("gpt_p2_measured", "gpt", 2, 4, extra=("--measure_memory",)),
    _job("gpt_p2_bf16_recompute", "gpt", 2, 6, bf16=True, recompute=True),  # v = 3
    _job("mlp_p4_recompute", "mlp", 4, 8, recompute=True),
    _job("gpt_p4_bf16", "gpt", 4, 8, bf16=True, adamw=True),
    _job("mlp_p2_r2_replicated", "mlp", 4, 4, replicas=2),
    _job("gpt_p2_r2_replicated_bf16_adamw", "gpt", 4, 6, replicas=2, bf16=True, adamw=True),
]


def _pipeline(job: dict) -> int:
    return job["world"] // job["replicas"]


def _ranks(job: dict, k: int) -> list[int]:
    """Replica i of stage k on rank k % p + i p."""
    p = _pipeline(job)
    return [k % p + i * p for i in range(job["replicas"])]


def _argv(job: dict, root) -> list[str]:
    return job_argv(job, root, STEPS, "interleaved", _ranks)


def _reference(job: dict, plan: Plan) -> dict[str, torch.Tensor]:
    return reference_params(job, plan, STEPS)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("interleaved_precision")
    outputs = {}
    for world in sorted({j["world"] for j in JOBS}):
        jobs = [_argv(j, root) for j in JOBS if j["world"] == world]
        (root / f"jobs{world}.json").write_text(json.dumps(jobs))
        result = launch_workers(["--jobs", str(root / f"jobs{world}.json"), "--timeout", "60"], world, timeout=600)
        assert result.ok, result.summary()
        outputs[world] = result.output(0)
    return root, outputs


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=[j["name"] for j in JOBS])
def test_interleaved_recompute_and_bf16_match_single_process(worlds, job):
    root, outputs = worlds
    checkpoint = load_checkpoint(root / job["name"])
    assert checkpoint.extra["next_step"] == STEPS
    assert [s["ranks"] for s in checkpoint.world["plan"]["stages"]] == [_ranks(job, k) for k in range(job["stages"])]
    got = checkpoint.params()
    if job["bf16"]:  # mixed precision keeps float32 master weights
        assert {v.dtype for v in got.values()} == {torch.float32}
    want = _reference(job, Plan.from_dict(checkpoint.world["plan"]))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_relatively_close(got[key], value, TOL, f"{job['name']}: {key}")


@pytest.mark.slow
def test_measured_memory_rows_cover_a_rank_s_stages(worlds):
    """Under --measure_memory the row of rank 0 (stages 0 and 2) has measured bytes, below the prediction (the
    sum of each stage's in-flight upper bound); the other jobs' rows say n/a."""
    import re

    _, outputs = worlds
    rows = re.findall(r"^\s+0\s+0,2\s+(\d+\.\d+)\s+(\d+\.\d+)\s+[+-]\d+%\s+\S+\s+\S+\s+(\S+)\s+(\d+\.\d+)",
                      outputs[2], re.MULTILINE)
    assert len(rows) == 1, outputs[2]
    predicted, measured, predicted_activations, measured_activations = map(float, rows[0])
    assert 0 < measured <= predicted and 0 < measured_activations <= predicted_activations
