"""Tied parameters split across stages train as one parameter: on 2 and 4 processes, with SGD momentum
and AdamW, clipping, a replicated stage, live plan switches that move the tied layers, and a resume on
another worker count, every parameter equals single-process training within 1e-5 (relative) and the
copies of a tie are bitwise identical on every rank holding one. Also a tied Hugging Face GPT-2
(profiled through torch.export) split across 2 processes; and copies that start different are refused."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import TESTS
import torch

import model_parallel  # noqa: F401  (the torchvision repair transformers needs)
from model_parallel.codegen.naming import find_ties
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import read_graph_json, write_graph_json
from model_parallel.graph.plan import write_plan
from model_parallel.messages import Command
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.launch import LocalWorld, free_port
from support import assert_relatively_close
from support.tied import TiedJob, cut, reference_state, write_jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TOL = 1e-5
RANK_SCRIPT = TESTS / "support" / "tied_rank.py"
BLOCK0, BLOCK1, HEAD = "blocks_0_ln1", "blocks_1_ln1", "ln_f"  # where the TinyGPT's stages start


def _world(jobs: Path, world_size: int, timeout: float = 600) -> str:
    port = free_port()
    commands = [[sys.executable, str(RANK_SCRIPT), str(r), str(world_size), str(port), str(jobs)]
                for r in range(world_size)]
    with LocalWorld(commands) as world:
        result = world.wait(timeout)
    assert result.ok, result.summary()
    return "\n".join(w.output for w in result.workers)


def _plan(root: Path, name: str, graph: Graph, starts: list[str], ranks: list[tuple[int, ...]]) -> str:
    write_plan(cut(graph, starts, ranks), root / f"{name}.json")
    return str(root / f"{name}.json")


def _switch_script(root: Path, graph: Graph) -> str:
    """2 stages on ranks 0,1 -> 3 stages on ranks 2,0,3 (both tied layers move) -> one stage on rank 1 (the
    tie inside one stage) -> 2 stages where rank 1 keeps the head and the embedding moves to rank 3."""
    plans = {3: cut(graph, [BLOCK0, HEAD], [(2,), (0,), (3,)], version=1),
             6: cut(graph, [], [(1,)], version=2),
             8: cut(graph, [BLOCK0], [(3,), (1,)], version=3)}
    path = root / "switch.json"
    path.write_text(json.dumps({k: Command.switch(p, "move the tied layers").to_dict() for k, p in plans.items()}))
    return str(path)


@pytest.fixture(scope="module")
def gpt_graph(tmp_path_factory) -> tuple[Path, Graph]:
    root = tmp_path_factory.mktemp("tied")
    job = TiedJob("trace", "gpt", "", "", 0, "")
    graph, _ = trace_model(job.build(), (job.data().batch(0)[0][0][:2],))
    write_graph_json(graph, root / "gpt.json")
    return root, graph


def _gpt_jobs(root: Path, graph: Graph) -> tuple[list[TiedJob], list[TiedJob]]:
    g = str(root / "gpt.json")
    four = [
        TiedJob("gpt4_adamw_clip", "gpt", g, _plan(root, "four", graph, [BLOCK0, BLOCK1, HEAD], [(0,), (1,), (2,), (3,)]),
                12, str(root / "gpt4_adamw_clip"), optimizer="adamw", lr=0.01, clip_grad=0.3),
        TiedJob("gpt3_replicated_sgd", "gpt", g, _plan(root, "replicated", graph, [BLOCK1, HEAD], [(0, 1), (2,), (3,)]),
                10, str(root / "gpt3_replicated_sgd")),
        TiedJob("gpt_switching_adamw", "gpt", g, _plan(root, "two", graph, [HEAD], [(0,), (1,)]), 11,
                str(root / "gpt_switching_adamw"), optimizer="adamw", lr=0.01, control_script=_switch_script(root, graph)),
        TiedJob("gpt_resume_part1", "gpt", g, str(root / "four.json"), 5, str(root / "gpt_resume_part1"),
                checkpoint_dir=str(root / "checkpoints")),
    ]
    two = [
        TiedJob("gpt2_sgd", "gpt", g, _plan(root, "halves", graph, [BLOCK1], [(0,), (1,)]), 15, str(root / "gpt2_sgd")),
        TiedJob("gpt_resume", "gpt", g, str(root / "halves.json"), 10, str(root / "gpt_resume"),
                checkpoint_dir=str(root / "checkpoints"), resume=True),
        TiedJob("gpt_seed_per_rank", "gpt", g, str(root / "halves.json"), 1, str(root / "unused"),
                extra={"seed_per_rank": True}),
        TiedJob("gpt_nan_tie", "gpt", g, str(root / "halves.json"), 1, str(root / "unused"),
                extra={"nan_on_rank_1": "token_embedding.weight"}),
    ]
    return four, two


def _hf_job(root: Path) -> tuple[TiedJob, Graph]:
    from model_parallel.profiler.api import profile
    from model_parallel.runtime.build.stages import even_plan

    job = TiedJob("hf_gpt2_sgd", "gpt2", str(root / "gpt2.json"), str(root / "gpt2_plan.json"), 10, str(root / "hf_gpt2_sgd"))
    model = job.build()
    graph = profile(model, (job.data().batch(0)[0][0][:2],), warmup=0, iterations=1, subtract_overhead=False)
    assert graph.metadata["route"] == "export" and graph.tie_groups() == (("transformer.wte.weight", "lm_head.weight"),)
    write_graph_json(graph, Path(job.graph))
    write_plan(even_plan(graph, 2), Path(job.plan))
    return job, read_graph_json(job.graph)


@pytest.fixture(scope="module")
def worlds(gpt_graph) -> dict[str, tuple[TiedJob, Graph, str]]:
    root, graph = gpt_graph
    four, two = _gpt_jobs(root, graph)
    hf, hf_graph = _hf_job(root)
    out4 = _world(write_jobs(four, root / "four_jobs.json"), 4)
    out2 = _world(write_jobs(two + [hf], root / "two_jobs.json"), 2)  # after `four`: resumes its checkpoint
    jobs = {job.name: (job, graph, out4) for job in four}
    jobs.update({job.name: (job, graph, out2) for job in two})
    jobs[hf.name] = (hf, hf_graph, out2)
    return jobs


def _tie_keys(graph: Graph) -> set[str]:
    (tie,) = find_ties(graph)
    return {path for _, path in tie.users}


CHECKED = ["gpt4_adamw_clip", "gpt3_replicated_sgd", "gpt_switching_adamw", "gpt2_sgd", "gpt_resume", "hf_gpt2_sgd"]


@pytest.mark.parametrize("name", CHECKED)
def test_split_tie_trains_like_one_process_and_copies_stay_identical(worlds, name: str) -> None:
    job, graph, _ = worlds[name]
    want = reference_state(job, graph)
    ranks = sorted(Path(job.out).glob("rank*.pt"))
    saved = {int(p.stem[4:]): torch.load(p, weights_only=True) for p in ranks}
    covered: set[str] = set()
    copies: dict[int, torch.Tensor] = {}
    tie = _tie_keys(graph)
    for rank, data in saved.items():
        for key, value in data["state"].items():
            if key not in want:
                continue  # a buffer the original model keeps elsewhere (none of these are trained)
            assert_relatively_close(value, want[key], TOL, f"{name}: rank {rank} {key}")
            covered.add(key)
            if key in tie:
                copies[rank] = value
    assert covered == set(want), f"{name}: no rank holds {sorted(set(want) - covered)}"
    assert len(copies) >= 2, f"{name}: the tie ({sorted(tie)}) ended on one rank only ({sorted(copies)}): nothing was split"
    first = next(iter(copies.values()))
    assert all(torch.equal(first, c) for c in copies.values()), f"{name}: the tied copies differ across ranks {sorted(copies)}"


def test_the_replicated_stage_and_the_head_hold_three_identical_copies(worlds) -> None:
    job, graph, _ = worlds["gpt3_replicated_sgd"]
    states = {r: torch.load(Path(job.out) / f"rank{r}.pt", weights_only=True)["state"] for r in range(4)}
    assert torch.equal(states[0]["token_embedding.weight"], states[1]["token_embedding.weight"])
    assert torch.equal(states[0]["token_embedding.weight"], states[3]["head.weight"])
    assert "head.weight" not in states[0] and "token_embedding.weight" not in states[3]


def test_live_switches_moved_the_tied_layers(worlds) -> None:
    job, _, output = worlds["gpt_switching_adamw"]
    states = {r: torch.load(Path(job.out) / f"rank{r}.pt", weights_only=True) for r in range(4)}
    assert {d["plan_version"] for d in states.values()} == {3}
    assert "token_embedding.weight" in states[3]["state"] and "head.weight" in states[1]["state"]
    assert f"rank 0: {job.name} done on plan v3" in output


def test_a_checkpoint_stores_a_tie_once_and_resumes_on_another_worker_count(worlds, gpt_graph) -> None:
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    root, _ = gpt_graph
    job, _, _ = worlds["gpt_resume"]
    checkpoint = load_checkpoint(root / "checkpoints")
    assert checkpoint.extra["next_step"] == job.steps and checkpoint.world["world_size"] == 2
    assert "token_embedding.weight" in checkpoint.param_names and "head.weight" not in checkpoint.param_names
    assert "head.weight" not in checkpoint.buffer_names


def test_a_tie_that_is_not_finite_is_named_a_divergence_not_a_seed_fault(worlds) -> None:
    # A user's run at --lr 1e4 went NaN and was told to check its seeds (NaN never equals NaN).
    _, _, output = worlds["gpt_nan_tie"]
    for rank in (0, 1):  # rank 0's copy is finite: it hears of rank 1's through the check's one all-reduce
        assert (f"rank {rank}: gpt_nan_tie refused: the tie (token_embedding.weight, head.weight) on stages [0, 1], "
                "ranks [0, 1] holds non-finite values (NaN or inf) when plan v0 was activated: the training diverged"
                ) in output, output


def test_copies_that_start_different_are_refused(worlds) -> None:
    _, _, output = worlds["gpt_seed_per_rank"]
    for rank in (0, 1):
        assert (f"rank {rank}: gpt_seed_per_rank refused: the copies of the tie (token_embedding.weight, head.weight) "
                "on stages [0, 1], ranks [0, 1] differ when plan v0 was activated") in output, output
