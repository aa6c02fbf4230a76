"""The multi-stage zero-bubble schedules with every per-stage feature, on 2 and 4 processes, against single-process
training of the same stages within 1e-5: interleaved zero bubble (`zbinterleaved`, loop placement) and ZBV (`zbv`,
a V: stage p-1 hands to stage p on its rank through a mailbox) with replicas (replica i of a V on ranks i p ..), bf16 autocast (the mailbox rounds the hand-off
to bf16 as a message would) and activation recomputation; `zbinterleaved` with replicas (replica i of stage k on
rank k % p + i p, as interleaved places them) and `--measure_memory` (one meter over a rank's stages); and a GPT head tied to its token embedding across stages (the tie's
all-reduce runs after the rank's last W; under zbv both users sit on rank 0); and live switches between loop plans
under zbinterleaved. One world per size and launcher."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model_parallel.codegen.naming import find_ties, state_key
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import read_graph_json, write_graph_json
from model_parallel.graph.plan import Plan, StagePlan, write_plan
from model_parallel.messages import Command
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import LocalWorld, free_port, launch_workers
from model_parallel.runtime.trainer import single_process_reference
from support import TESTS, assert_relatively_close
from support.multi_stage_jobs import job_argv, reference_params
from support.tied import TiedJob, reference_state, write_jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TOL = 1e-5
STEPS = 3


def _job(name: str, model: str, schedule: str, world: int, stages: int, *, bf16: bool = False,
         recompute: bool = False, adamw: bool = False, replicas: int = 1, extra: tuple[str, ...] = ()) -> dict:
    return {"name": name, "model": model, "schedule": schedule, "world": world, "stages": stages, "bf16": bf16,
            "recompute": recompute, "adamw": adamw, "replicas": replicas, "extra": list(extra)}


JOBS = [
    _job("mlp_p2_zbinterleaved_bf16", "mlp", "zbinterleaved", 2, 4, bf16=True),
    _job("gpt_p2_zbinterleaved_recompute_adamw", "gpt", "zbinterleaved", 2, 4, recompute=True, adamw=True),
    _job("gpt_p2_zbinterleaved_v3_bf16_recompute", "gpt", "zbinterleaved", 2, 6, bf16=True, recompute=True),
    # --measure_memory: one StashMeter per rank over its stages (a microbatch released at its W), in the table
    _job("gpt_p2_zbinterleaved_measured", "gpt", "zbinterleaved", 2, 4, extra=("--measure_memory",)),
    _job("gpt_p2_zbv_measured", "gpt", "zbv", 2, 4, extra=("--measure_memory",)),  # rank 0's row: stages 0,3
    _job("mlp_p2_zbv_bf16", "mlp", "zbv", 2, 4, bf16=True),
    _job("gpt_p2_zbv_bf16_recompute_adamw", "gpt", "zbv", 2, 4, bf16=True, recompute=True, adamw=True),
    _job("gpt_p4_zbv_bf16", "gpt", "zbv", 4, 8, bf16=True),
    _job("mlp_p4_zbinterleaved_recompute", "mlp", "zbinterleaved", 4, 8, recompute=True),
    _job("mlp_p2_r2_zbinterleaved_replicated", "mlp", "zbinterleaved", 4, 4, replicas=2),
    _job("gpt_p2_r2_zbinterleaved_replicated_bf16_adamw", "gpt", "zbinterleaved", 4, 4, replicas=2, bf16=True,
         adamw=True),
    _job("mlp_p2_r2_zbv_replicated", "mlp", "zbv", 4, 4, replicas=2),  # two Vs: ranks 0,1 and 2,3
    _job("gpt_p2_r2_zbv_replicated_bf16_recompute_adamw", "gpt", "zbv", 4, 4, replicas=2, bf16=True, recompute=True,
         adamw=True),
]


def _ranks(job: dict, k: int) -> list[int]:
    """Replica i of stage k on rank min(k, 2p-1-k) + i p (zbv's V) or k % p + i p (zbinterleaved's loop)."""
    p = job["world"] // job["replicas"]
    first = min(k, job["stages"] - 1 - k) if job["schedule"] == "zbv" else k % p
    return [first + i * p for i in range(job["replicas"])]


def _argv(job: dict, root) -> list[str]:
    return job_argv(job, root, STEPS, job["schedule"], _ranks)


def _reference(job: dict, plan: Plan) -> dict[str, torch.Tensor]:
    return reference_params(job, plan, STEPS)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> tuple[Path, dict[int, str]]:
    root = tmp_path_factory.mktemp("zero_bubble_full")
    outputs = {}
    for world in sorted({j["world"] for j in JOBS}):
        jobs = [_argv(j, root) for j in JOBS if j["world"] == world]
        (root / f"jobs{world}.json").write_text(json.dumps(jobs))
        result = launch_workers(["--jobs", str(root / f"jobs{world}.json"), "--timeout", "60"], world, timeout=600)
        assert result.ok, result.summary()
        outputs[world] = result.output(0)
    return root, outputs


@pytest.mark.parametrize("job", JOBS, ids=[j["name"] for j in JOBS])
def test_zero_bubble_with_bf16_recompute_and_replicas_matches_single_process(worlds, job: dict) -> None:
    checkpoint = load_checkpoint(worlds[0] / job["name"])
    assert checkpoint.extra["next_step"] == STEPS
    assert [s["ranks"] for s in checkpoint.world["plan"]["stages"]] == [_ranks(job, k) for k in range(job["stages"])]
    got = checkpoint.params()
    if job["bf16"]:  # mixed precision keeps float32 master weights
        assert {v.dtype for v in got.values()} == {torch.float32}
    want = _reference(job, Plan.from_dict(checkpoint.world["plan"]))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_relatively_close(got[key], value, TOL, f"{job['name']}: {key}")


@pytest.mark.parametrize("stages", ["0,2", "0,3"], ids=["zbinterleaved", "zbv"])
def test_measured_memory_rows_cover_a_rank_s_stages(worlds, stages: str) -> None:
    """Under --measure_memory the row of rank 0 (stages 0 and 2 in a loop, 0 and 3 in a V) has measured bytes,
    below the prediction (each stage's in-flight bound); the other jobs of the world print their rows as n/a."""
    rows = re.findall(rf"^\s+0\s+{stages}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+[+-]\d+%\s+\S+\s+\S+\s+(\S+)\s+(\d+\.\d+)",
                      worlds[1][2], re.MULTILINE)
    assert len(rows) == 1, worlds[1][2]
    predicted, measured, predicted_activations, measured_activations = map(float, rows[0])
    assert 0 < measured <= predicted and 0 < measured_activations <= predicted_activations


# ---- a tie split across stages ---------------------------------------------------------------------------
# name, schedule, world, stages, replicas, job fields
TIE_CASES = [
    ("gpt_p2_zbinterleaved", "zbinterleaved", 2, 4, 1, {}),  # the tie on ranks 0 and 1
    ("gpt_p2_zbv_adamw_clip", "zbv", 2, 4, 1, {"optimizer": "adamw", "lr": 0.01, "clip_grad": 0.3}),  # both on rank 0
    ("gpt_p4_zbinterleaved_adamw_clip", "zbinterleaved", 4, 8, 1, {"optimizer": "adamw", "lr": 0.01, "clip_grad": 0.3}),
    ("gpt_p2_r2_zbinterleaved_clip", "zbinterleaved", 4, 4, 2, {"clip_grad": 0.3}),  # four copies on four ranks
    ("gpt_p2_r2_zbv_clip", "zbv", 4, 4, 2, {"clip_grad": 0.3}),  # one copy on each V's rank 0 (ranks 0 and 2)
]


def _placed(plan: Plan, schedule: str, world: int, replicas: int) -> Plan:
    p = world // replicas

    def first(k: int) -> int:
        return min(k, plan.num_stages - 1 - k) if schedule == "zbv" else k % p
    return replace(plan, stages=tuple(replace(s, ranks=tuple(first(s.stage_id) + i * p for i in range(replicas)),
                                              num_replicas=replicas) for s in plan.stages))


@pytest.fixture(scope="module")
def tie_worlds(tmp_path_factory) -> tuple[dict[str, tuple[TiedJob, int, int]], Graph]:
    root = tmp_path_factory.mktemp("zero_bubble_ties")
    trace = TiedJob("trace", "gpt", "", "", 0, "")
    traced, _ = trace_model(trace.build(), (trace.data().batch(0)[0][0][:2],))
    write_graph_json(traced, root / "gpt.json")
    graph = read_graph_json(root / "gpt.json")
    jobs: dict[str, tuple[TiedJob, int, int]] = {}
    for name, schedule, world, stages, replicas, fields in TIE_CASES:
        job = TiedJob(name, "gpt", str(root / "gpt.json"), str(root / f"{name}_plan.json"), 4, str(root / name),
                      schedule=schedule, **fields)
        write_plan(_placed(even_plan(graph, stages), schedule, world, replicas), Path(job.plan))
        jobs[name] = (job, world, replicas)
    for world in (2, 4):
        path = write_jobs([j for j, w, _ in jobs.values() if w == world], root / f"jobs{world}.json")
        port = free_port()
        commands = [[sys.executable, str(TESTS / "support" / "tied_rank.py"), str(r), str(world), str(port), str(path)]
                    for r in range(world)]
        with LocalWorld(commands) as running:
            result = running.wait(600)
        assert result.ok, result.summary()
    return jobs, graph


@pytest.mark.parametrize("name", [c[0] for c in TIE_CASES])
def test_zero_bubble_tie_across_stages_trains_like_one_process(tie_worlds, name: str) -> None:
    jobs, graph = tie_worlds
    job, world, replicas = jobs[name]
    want = reference_state(job, graph)
    (tie,) = find_ties(graph)
    tie_keys = {path for _, path in tie.users}
    covered: set[str] = set()
    copies: dict[int, torch.Tensor] = {}
    for rank in range(world):
        for key, value in torch.load(Path(job.out) / f"rank{rank}.pt", weights_only=True)["state"].items():
            if key not in want:
                continue  # a buffer the original model keeps elsewhere
            assert_relatively_close(value, want[key], TOL, f"{name}: rank {rank} {key}")
            covered.add(key)
            if key in tie_keys:
                copies[rank] = value
    assert covered == set(want), f"{name}: no rank holds {sorted(set(want) - covered)}"
    p = world // replicas  # stage 0 on ranks i p; the last on ranks i p + p - 1 (loop) or on rank 0 (V)
    last = 0 if job.schedule == "zbv" else p - 1
    assert set(copies) == {r for i in range(replicas) for r in (i * p, i * p + last)}, name
    first = next(iter(copies.values()))
    assert all(torch.equal(first, c) for c in copies.values()), f"{name}: the tied copies differ across ranks"


# ---- live switches between loop plans ---------------------------------------------------------------------
def test_zbinterleaved_switches_between_loop_plans_stay_exact(tmp_path: Path) -> None:
    """At step 2 the MLP's 4 stages get other cuts (layers cross between the ranks), at step 4 they become 6
    stages, 3 per rank; a switch to one stage per rank (step 5) is refused and training goes on."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    order = list(graph.topological_order)
    bounds = [0, 3, 5, 9, len(order)]
    moved = Plan(stages=tuple(StagePlan(k, tuple(order[a:b]), ranks=(k % 2,))
                              for k, (a, b) in enumerate(zip(bounds, bounds[1:]))), version=1)
    six = even_plan(graph, 6)
    plans = {2: moved, 4: replace(six, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in six.stages), version=2),
             5: replace(even_plan(graph, 2), version=3)}
    script = tmp_path / "switch.json"
    script.write_text(json.dumps({k: Command.switch(p, "test").to_dict() for k, p in plans.items()}))
    steps = 7
    result = launch_workers(["--model", "mlp", "--schedule", "zbinterleaved", "--steps", str(steps), "--timeout", "60",
                             "--optimizer", "adamw", "--lr", "0.003", "--checkpoint_dir", str(tmp_path / "ckpt"),
                             "--control_script", str(script)], 2, timeout=300)
    assert result.ok, result.summary()
    out = result.output(0)
    assert "switched to plan v1" in out and "switched to plan v2" in out and "[rank 0 stage 0,2,4]" in out
    assert "refusing the switch to plan v3" in out and "needs loop placement over p >= 2 ranks" in out
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    assert checkpoint.extra["next_step"] == steps and checkpoint.world["plan"]["version"] == 2
    model = r.model(0)
    single_process_reference(model, r.criterion, lambda ps: torch.optim.AdamW(ps, lr=0.003, weight_decay=0.0),
                             r.data(8, 0), TrainConfig(batch_size=8, num_microbatches=4), steps)
    got = checkpoint.params()
    for name, value in model.named_parameters():
        assert_relatively_close(got[state_key(name)], value.detach(), TOL, name)


def _v(plan: Plan, p: int, version: int) -> Plan:
    """Stage k on rank min(k, 2p-1-k)."""
    return replace(plan, stages=tuple(replace(s, ranks=(min(s.stage_id, 2 * p - 1 - s.stage_id),)) for s in plan.stages),
                   version=version)


@pytest.mark.parametrize("world", [2, 4])
def test_zbv_switches_between_v_plans_stay_exact(tmp_path: Path, world: int) -> None:
    """2 processes: at step 2 the V gets other cuts (layers cross between the ranks), a switch to a loop plan
    (step 3) is refused. 4 processes: a V over ranks 0 and 1 (2 and 3 spare) becomes a V over all four (step 2)."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    order = list(graph.topological_order)
    four = even_plan(graph, 4)
    bounds = [0, 3, 5, 9, len(order)]
    cuts = Plan(stages=tuple(StagePlan(k, tuple(order[a:b])) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))))
    if world == 2:
        plans = {2: _v(cuts, 2, 1), 3: replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in four.stages),
                                              version=2)}
    else:
        plans = {2: _v(even_plan(graph, 8), 4, 1)}
    (tmp_path / "plan.json").write_text(json.dumps(_v(four, 2, 0).to_dict()))
    script = tmp_path / "switch.json"
    script.write_text(json.dumps({k: Command.switch(p, "test").to_dict() for k, p in plans.items()}))
    steps = 5
    result = launch_workers(["--model", "mlp", "--schedule", "zbv", "--steps", str(steps), "--timeout", "60",
                             "--optimizer", "adamw", "--lr", "0.003", "--checkpoint_dir", str(tmp_path / "ckpt"),
                             "--plan", str(tmp_path / "plan.json"), "--control_script", str(script)], world, timeout=300)
    assert result.ok, result.summary()
    assert "switched to plan v1" in result.output(0)
    if world == 2:
        assert "refusing the switch to plan v2" in result.output(0) and "needs 2p stages on p >= 2 ranks in a V" in result.output(0)
    else:
        assert "[rank 3 stage 3,4]" in result.output(3)
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    assert checkpoint.extra["next_step"] == steps and checkpoint.world["plan"]["version"] == 1
    assert [s["ranks"] for s in checkpoint.world["plan"]["stages"]] == [list(s.ranks) for s in plans[2].stages]
    model = r.model(0)
    single_process_reference(model, r.criterion, lambda ps: torch.optim.AdamW(ps, lr=0.003, weight_decay=0.0),
                             r.data(8, 0), TrainConfig(batch_size=8, num_microbatches=4), steps)
    got = checkpoint.params()
    for name, value in model.named_parameters():
        assert_relatively_close(got[state_key(name)], value.detach(), TOL, name)
