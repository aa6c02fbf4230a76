"""Tied weights under interleaved 1F1B (loop placement: stage k on rank k % p), on 2 and 4 processes.

The embedding (stage 0, rank 0) and the head (the last stage, rank p - 1) are copies on two ranks whose
gradients are summed before the one update per step; in `tiedlm_p2_same_rank` both users sit on rank 0
(stages 0 and 2) and are one Parameter there. TinyGPT with its head tied (SGD, AdamW with clipping) and a
tiny Hugging Face GPT-2 (wte tied to lm_head, random init) against single-process training within 1e-5;
the copies of a tie stay bitwise identical across ranks. `gpt_p2_r2_replicated_clip` runs two replicas of a
2-rank pipeline (replica i of stage k on rank k % 2 + 2i), clipping by the global norm: four copies of the tie;
`gpt_p2_switching_adamw` switches live from 4 to 6 stages after step 2."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import model_parallel  # noqa: F401  (the torchvision repair transformers needs)
from model_parallel.codegen.naming import find_ties
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import read_graph_json, write_graph_json
from model_parallel.graph.plan import Plan, write_plan
from model_parallel.messages import Command
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.launch import LocalWorld, free_port
from support import TESTS, assert_relatively_close
from support.tied import TiedJob, reference_state, write_jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TOL = 1e-5
RANK_SCRIPT = TESTS / "support" / "tied_rank.py"


def _loop(plan: Plan, world: int, replicas: int = 1) -> Plan:
    """Replica i of stage k on rank k % p + i p (p = world / replicas)."""
    p = world // replicas
    return replace(plan, stages=tuple(replace(s, ranks=tuple(s.stage_id % p + i * p for i in range(replicas)),
                                              num_replicas=replicas) for s in plan.stages))


def _graph(job: TiedJob, root: Path) -> Graph:
    if job.model == "gpt2":  # through torch.export, as the profiler takes it
        from model_parallel.profiler.api import profile

        graph = profile(job.build(), (job.data().batch(0)[0][0][:2],), warmup=0, iterations=1, subtract_overhead=False)
        assert graph.tie_groups() == (("transformer.wte.weight", "lm_head.weight"),)
    else:
        graph, _ = trace_model(job.build(), (job.data().batch(0)[0][0][:2],))
    write_graph_json(graph, root / f"{job.model}.json")
    return read_graph_json(root / f"{job.model}.json")


def _tiedlm_plan(graph: Graph) -> Plan:
    """4 stages on 2 ranks: [tokens, wte] [mid] [relu, lm_head] [out_norm ...]: both users of the tie on rank 0."""
    from model_parallel.graph.plan import StagePlan

    ids = list(graph.topological_order)
    cuts = [ids[:2], ids[2:3], ids[3:5], ids[5:]]
    assert "lm_head" in cuts[2] and "wte" in cuts[0]
    return Plan(stages=tuple(StagePlan(k, tuple(nodes), ranks=(k % 2,)) for k, nodes in enumerate(cuts)))


# name, model, world, stages, job fields
CASES = [
    ("gpt_p2_sgd", "gpt", 2, 4, {}),
    ("tiedlm_p2_same_rank", "tiedlm", 2, 4, {}),
    ("gpt2_hf_p2", "gpt2", 2, 4, {}),
    ("gpt_p4_adamw_clip", "gpt", 4, 8, {"optimizer": "adamw", "lr": 0.01, "clip_grad": 0.3}),
    ("gpt2_hf_p4", "gpt2", 4, 8, {}),
    ("gpt_p2_r2_replicated_clip", "gpt", 4, 4, {"clip_grad": 0.3}),  # two 2-rank pipelines: the tie on all 4 ranks
    ("gpt_p2_switching_adamw", "gpt", 2, 4, {"optimizer": "adamw", "lr": 0.01}),  # 4 stages, then 6 (SWITCHES)
]
SWITCHES = {"gpt_p2_switching_adamw": (2, 6)}  # a live switch after step 2 to the even loop plan of 6 stages
REPLICAS = {"gpt_p2_r2_replicated_clip": 2}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[str, tuple[TiedJob, Graph, int]]:
    root = tmp_path_factory.mktemp("interleaved_ties")
    graphs: dict[str, Graph] = {}
    jobs: dict[str, tuple[TiedJob, Graph, int]] = {}
    for name, model, world, stages, fields in CASES:
        job = TiedJob(name, model, str(root / f"{model}.json"), str(root / f"{name}_plan.json"), 4, str(root / name),
                      schedule="interleaved", **fields)
        if model not in graphs:
            graphs[model] = _graph(job, root)
        graph = graphs[model]
        if name in SWITCHES:  # the tie's holders stay ranks 0 and 1, the layers between them move
            step, stages_after = SWITCHES[name]
            after = replace(_loop(even_plan(graph, stages_after), world), version=1)
            script = root / f"{name}_switch.json"
            script.write_text(json.dumps({step: Command.switch(after, "test: 3 stages per rank").to_dict()}))
            job = replace(job, control_script=str(script))
        write_plan(_tiedlm_plan(graph) if model == "tiedlm" else _loop(even_plan(graph, stages), world, REPLICAS.get(name, 1)), Path(job.plan))
        jobs[name] = (job, graph, world)
    for world in (2, 4):
        path = write_jobs([j for j, _, w in jobs.values() if w == world], root / f"jobs{world}.json")
        port = free_port()
        commands = [[sys.executable, str(RANK_SCRIPT), str(r), str(world), str(port), str(path)] for r in range(world)]
        with LocalWorld(commands) as running:
            result = running.wait(600)
        assert result.ok, result.summary()
    return jobs


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_interleaved_tie_trains_like_one_process(worlds, name: str) -> None:
    job, graph, world = worlds[name]
    want = reference_state(job, graph)
    (tie,) = find_ties(graph)
    tie_keys = {path for _, path in tie.users}
    covered: set[str] = set()
    copies: dict[int, torch.Tensor] = {}
    for rank in range(world):
        saved = torch.load(Path(job.out) / f"rank{rank}.pt", weights_only=True)
        assert saved["plan_version"] == (1 if name in SWITCHES else 0), name
        state = saved["state"]
        for key, value in state.items():
            if key not in want:
                continue  # a buffer the original model keeps elsewhere
            assert_relatively_close(value, want[key], TOL, f"{name}: rank {rank} {key}")
            covered.add(key)
            if key in tie_keys:
                copies[rank] = value
    assert covered == set(want), f"{name}: no rank holds {sorted(set(want) - covered)}"
    p = world // REPLICAS.get(name, 1)  # stage 0 on ranks i p, the last on ranks i p + p - 1
    holders = {0} if job.model == "tiedlm" else {r for i in range(world // p) for r in (i * p, i * p + p - 1)}
    assert set(copies) == holders, f"{name}: the tie is held by ranks {sorted(copies)}, expected {sorted(holders)}"
    first = next(iter(copies.values()))
    assert all(torch.equal(first, c) for c in copies.values()), f"{name}: the tied copies differ across ranks"
