"""Interleaved 1F1B with the per-stage features: activation recomputation, bf16 autocast and replicas, on 2 and 4
processes (2 or 3 stages per rank, loop placement), each job against single-process training of the same stages
with the same data, microbatching, recomputation and autocast (SingleProcessRunner rounds at the same cuts: the
plan each job ran, the default split being the optimizer's loop plan balanced by rank),
every parameter within 1e-5 relative. One world per size runs all its jobs (`--jobs`). A replicated job runs
two copies of a 2-rank pipeline (replica i of stage k on rank k % 2 + 2i: microbatch j on replica j % 2) whose
ranks all-reduce their stages' gradients."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from model_parallel.codegen.naming import state_key
from model_parallel.graph.plan import Plan, write_plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.trainer import SingleProcessRunner
from support import assert_relatively_close

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
    argv = ["--model", job["model"], "--schedule", "interleaved", "--steps", str(STEPS), "--timeout", "60",
            "--num_stages", str(job["stages"]), "--num_microbatches", str(job["world"]),
            "--batch_size", str(2 * job["world"]), "--checkpoint_dir", str(root / job["name"])]
    argv += ["--bf16"] if job["bf16"] else []
    argv += ["--recompute", "all"] if job["recompute"] else []
    argv += ["--optimizer", "adamw", "--lr", "0.003"] if job["adamw"] else []
    argv += job["extra"]
    if job["replicas"] > 1:  # a plan file: the default split has one replica per stage
        r = recipe(job["model"])
        graph, _ = trace_model(r.model(0), r.example(2))
        plan = even_plan(graph, job["stages"])
        plan = replace(plan, stages=tuple(replace(s, ranks=tuple(_ranks(job, s.stage_id)), num_replicas=job["replicas"])
                                          for s in plan.stages))
        write_plan(plan, root / f"{job['name']}.plan.json")
        argv[argv.index("--num_stages"):argv.index("--num_stages") + 2] = ["--plan", str(root / f"{job['name']}.plan.json")]
    return argv


def _reference(job: dict, plan: Plan) -> dict[str, torch.Tensor]:
    """The same stages (`plan`, the one the workers ran: bf16 rounds at its cuts) in one process (1F1B order is
    irrelevant there: microbatch by microbatch)."""
    r = recipe(job["model"])
    model = r.model(0)
    graph, _ = trace_model(model, r.example(2))
    batch = 2 * job["world"]
    lr = 0.003 if job["adamw"] else 0.01
    if job["adamw"]:
        factory = lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)  # noqa: E731
    else:
        factory = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    config = TrainConfig(batch_size=batch, num_microbatches=job["world"], bf16=job["bf16"],
                         recompute=True if job["recompute"] else False)
    runner = SingleProcessRunner(graph, plan, model, r.criterion, factory, r.data(batch, 0), config)
    runner.train(STEPS)
    return {state_key(k): v.detach() for k, v in model.named_parameters()}  # the stages share its layers


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
