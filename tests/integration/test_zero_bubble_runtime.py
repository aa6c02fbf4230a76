"""Zero-bubble schedules (the backward split into I and W) run by the runtime on 2 and 4 processes against
single-process training, within 1e-5. ZB-H1 (`--schedule zbh1`): the zoo MLP (SGD, AdamW, a replicated stage,
bf16), the GPT with recomputation, and a GPT whose head is tied to its token embedding across stages (the
tie's all-reduce runs after the last W). Interleaved zero bubble (`--schedule zbinterleaved`, 2 and 3 stages
per rank in a loop) and ZBV (`--schedule zbv`, 2 stages per rank in a V; stage p-1 hands to stage p on its
rank without a message): the MLP and the GPT. The schedules' rules: tests/unit/runtime/test_zero_bubble.py."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from integration.test_runtime import _assert_close, _reference
from model_parallel.codegen.naming import find_ties
from model_parallel.graph.json_format import write_graph_json
from model_parallel.graph.plan import write_plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import LocalWorld, free_port, launch_workers
from support import TESTS, assert_relatively_close
from support.tied import TiedJob, cut, reference_state, write_jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _job(name: str, model: str, steps: int, *extra: str, schedule: str = "zbh1") -> dict:
    return {"name": name, "model": model, "steps": steps, "extra": ["--schedule", schedule, *extra], "whole_model": False}


JOBS = [
    _job("mlp4_zbh1", "mlp", 4, "--num_stages", "4", "--num_microbatches", "8", "--batch_size", "16"),
    _job("mlp2_zbh1_adamw", "mlp", 4, "--num_stages", "2", "--optimizer", "adamw", "--lr", "0.003"),
    _job("mlp3_zbh1_replicated", "mlp", 3, "--num_stages", "3", "--stage_to_num_ranks", "0:2",
         "--num_microbatches", "3", "--batch_size", "9"),
    _job("mlp3_zbh1_bf16", "mlp", 3, "--num_stages", "3", "--bf16"),
    _job("gpt4_zbh1_recompute", "gpt", 3, "--num_stages", "4", "--optimizer", "adamw", "--lr", "0.003",
         "--recompute", "all"),
    _job("mlp8_zbinterleaved_adamw", "mlp", 4, "--num_microbatches", "8", "--batch_size", "16", "--optimizer", "adamw",
         "--lr", "0.003", schedule="zbinterleaved"),  # 8 stages, 2 per rank
    _job("mlp8_zbv", "mlp", 4, "--num_microbatches", "8", "--batch_size", "16", schedule="zbv"),  # 8 stages in a V
    _job("gpt8_zbv_adamw", "gpt", 3, "--num_microbatches", "4", "--optimizer", "adamw", "--lr", "0.003", schedule="zbv"),
]


@pytest.fixture(scope="module")
def jobs_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zb_jobs")
    argv = [["--model", job["model"], "--steps", str(job["steps"]), "--timeout", "60",
             "--checkpoint_dir", str(root / job["name"]), *job["extra"]] for job in JOBS]
    (root / "jobs.json").write_text(json.dumps(argv))
    result = launch_workers(["--jobs", str(root / "jobs.json"), "--timeout", "60"], 4, timeout=600)
    assert result.ok, result.summary()
    return root


@pytest.mark.parametrize("job", JOBS, ids=[j["name"] for j in JOBS])
def test_zbh1_matches_single_process(jobs_root: Path, job: dict) -> None:
    checkpoint = load_checkpoint(jobs_root / job["name"])
    assert checkpoint.extra["next_step"] == job["steps"]
    _assert_close(job["name"], checkpoint.params(), _reference(job))


@pytest.mark.parametrize("world, starts", [(2, ["blocks_1_ln1"]), (4, ["blocks_0_ln1", "blocks_1_ln1", "ln_f"])],
                         ids=["p2", "p4"])
def test_zbh1_with_a_tie_across_stages_trains_like_one_process(tmp_path: Path, world: int, starts: list[str]) -> None:
    trace = TiedJob("trace", "gpt", "", "", 0, "")
    graph, _ = trace_model(trace.build(), (trace.data().batch(0)[0][0][:2],))
    write_graph_json(graph, tmp_path / "gpt.json")
    write_plan(cut(graph, starts, [(r,) for r in range(world)]), tmp_path / "plan.json")
    job = TiedJob(f"gpt{world}_zbh1_tied", "gpt", str(tmp_path / "gpt.json"), str(tmp_path / "plan.json"), 6,
                  str(tmp_path / "out"), extra={"schedule": "zbh1"})
    jobs, port = write_jobs([job], tmp_path / "jobs.json"), free_port()
    commands = [[sys.executable, str(TESTS / "support" / "tied_rank.py"), str(r), str(world), str(port), str(jobs)]
                for r in range(world)]
    with LocalWorld(commands) as running:
        result = running.wait(600)
    assert result.ok, result.summary()
    want = reference_state(job, graph)
    (tie,) = find_ties(graph)
    tie_keys = {path for _, path in tie.users}
    copies, covered = [], set()
    for r in range(world):
        for key, value in torch.load(Path(job.out) / f"rank{r}.pt", weights_only=True)["state"].items():
            if key in want:  # (buffers the original model keeps elsewhere are not trained)
                assert_relatively_close(value, want[key], 1e-5, f"rank {r} {key}")
                covered.add(key)
                copies += [value] if key in tie_keys else []
    assert covered == set(want)
    assert len(copies) == 2 and torch.equal(copies[0], copies[1]), "the tie's two copies, on the first and last rank"


@pytest.mark.parametrize("extra", [["--num_microbatches", "4"], ["--num_microbatches", "2", "--num_stages", "6"]],
                         ids=["p2_v2_m4", "p2_v3_m2"])
def test_zbinterleaved_on_2_processes_matches_single_process(tmp_path: Path, extra: list[str]) -> None:
    job = _job("mlp_zbinterleaved", "mlp", 4, *extra, schedule="zbinterleaved")
    result = launch_workers(["--model", "mlp", "--steps", "4", "--timeout", "60", "--checkpoint_dir",
                             str(tmp_path / "ckpt"), "--trace_dir", str(tmp_path / "trace"), *job["extra"]], 2, timeout=300)
    assert result.ok, result.summary()
    flags = dict(zip(extra[::2], extra[1::2]))
    stages = int(flags.get("--num_stages", 4))
    assert f"[rank 0 stage {','.join(str(k) for k in range(0, stages, 2))}]" in result.output(0)  # loop placement
    _assert_traced_actions(tmp_path / "trace", {r: range(r, stages, 2) for r in range(2)}, int(flags["--num_microbatches"]), 4)
    _assert_close(job["name"], load_checkpoint(tmp_path / "ckpt").params(), _reference(job))


@pytest.mark.parametrize("m", [2, 4])
def test_zbv_on_2_processes_matches_single_process(tmp_path: Path, m: int) -> None:
    # m = 4 also validates every 2 steps: forward-only through the V, stage p-1 to p through the mailbox
    evaluate = ["--eval_every", "2", "--eval_data", "synthetic"] if m == 4 else []
    job = _job("mlp_zbv", "mlp", 4, "--num_microbatches", str(m), *evaluate, schedule="zbv")
    result = launch_workers(["--model", "mlp", "--steps", "4", "--timeout", "60", "--checkpoint_dir",
                             str(tmp_path / "ckpt"), "--trace_dir", str(tmp_path / "trace"), *job["extra"]], 2, timeout=300)
    assert result.ok, result.summary()
    assert "[rank 0 stage 0,3]" in result.output(0) and "[rank 1 stage 1,2]" in result.output(1)  # the V
    _assert_traced_actions(tmp_path / "trace", {0: (0, 3), 1: (1, 2)}, m, 4)
    assert ("val_loss" in result.output(0)) == bool(evaluate)
    _assert_close(job["name"], load_checkpoint(tmp_path / "ckpt").params(), _reference(job))


def _assert_traced_actions(trace_dir: Path, rank_stages: dict, m: int, steps: int) -> None:
    """Each rank's trace names every action's own stage (a rank holds several) and the backward's part: per stage,
    microbatch and step one `forward`, one `backward I` and one `backward W` span."""
    for rank, stages in rank_stages.items():
        events = json.loads((trace_dir / f"rank{rank}.json").read_text())
        actions = Counter((e["name"], e["args"]["stage"], e["args"]["microbatch"]) for e in events
                          if e.get("cat") == "compute" and e["name"] in ("forward", "backward I", "backward W", "backward"))
        want = Counter({(name, k, j): steps for name in ("forward", "backward I", "backward W") for k in stages
                        for j in range(m)})
        assert actions == want, (rank, sorted(set(actions) ^ set(want))[:8])
        receives = {e["args"]["stage"] for e in events if e.get("name") == "recv"}
        assert receives <= set(stages), (rank, receives)
