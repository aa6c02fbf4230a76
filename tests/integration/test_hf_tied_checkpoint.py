"""A tied Hugging Face GPT-2 checkpointed on one partition resumes exactly on another (issue #24).

GPT-2 with `tie_word_embeddings=True` (profiled through torch.export: `transformer.wte.weight` and
`lm_head.weight` are one tensor read by the first and the last stage) trains 5 steps on 2 processes
(SGD with momentum, so optimizer state is part of what resumes) and checkpoints; 3 processes then
resume it on 3 stages (other cuts, the tie on ranks 0 and 2) and train to step 10. Every parameter
equals 10 uninterrupted steps in one process within 1e-5 relative, the tied copies are bitwise equal
on both ranks that hold one, and the checkpoint stores the tied tensor (and its momentum) once.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import TESTS
import torch

from model_parallel.codegen.naming import find_ties, layer_name  # noqa: E402
from model_parallel.graph.core import Graph  # noqa: E402
from model_parallel.graph.json_format import read_graph_json, write_graph_json  # noqa: E402
from model_parallel.graph.plan import Plan, write_plan  # noqa: E402
from model_parallel.profiler.trace import trace_model  # noqa: E402
from model_parallel.runtime.build.stages import even_plan  # noqa: E402
from model_parallel.runtime.checkpoint.layout import list_checkpoints  # noqa: E402
from model_parallel.runtime.checkpoint.store import load_checkpoint  # noqa: E402
from model_parallel.runtime.launch import LocalWorld, free_port  # noqa: E402
from support import assert_relatively_close  # noqa: E402
from support.tied import TiedJob, reference_state, write_jobs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOL = 1e-5
RANK_SCRIPT = TESTS / "support" / "tied_rank.py"
FIRST, TOTAL = 5, 10  # steps before the checkpoint, steps in all


def _world(jobs: Path, world_size: int) -> str:
    port = free_port()
    commands = [[sys.executable, str(RANK_SCRIPT), str(r), str(world_size), str(port), str(jobs)]
                for r in range(world_size)]
    with LocalWorld(commands) as world:
        result = world.wait(300)
    assert result.ok, result.summary()
    return "\n".join(w.output for w in result.workers)


def _stages(plan: Plan, graph: Graph, keys: set[str]) -> list[int]:
    """The stages that read one of these layers."""
    nodes = {n.node_id for n in graph.nodes if n.layer is not None and layer_name(n.layer.target) in keys}
    return [s.stage_id for s in plan.stages if nodes & set(s.node_ids)]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, TiedJob, Graph, set[str]]:
    root = tmp_path_factory.mktemp("hf_tied")
    resume = TiedJob("hf_gpt2_resume", "gpt2", str(root / "gpt2.json"), str(root / "three.json"), TOTAL,
                     str(root / "resumed"), checkpoint_dir=str(root / "checkpoints"), resume=True)
    model = resume.build()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.transformer.wte.weight
    graph, _ = trace_model(model, (resume.data().batch(0)[0][0][:2],))
    assert graph.metadata["route"] == "export"
    write_graph_json(graph, Path(resume.graph))
    graph = read_graph_json(resume.graph)
    (tie,) = find_ties(graph)
    keys = {path for _, path in tie.users}
    assert keys == {"transformer_wte_weight", "lm_head_weight"}  # stage state keys (bare tensors)
    two, three = even_plan(graph, 2), even_plan(graph, 3)
    assert _stages(two, graph, keys) == [0, 1] and _stages(three, graph, keys) == [0, 2]  # the tie is split
    assert {s.node_ids[0] for s in two.stages[1:]}.isdisjoint(s.node_ids[0] for s in three.stages[1:])  # other cuts
    write_plan(two, root / "two.json")
    write_plan(three, Path(resume.plan))
    first = TiedJob("hf_gpt2_first", "gpt2", resume.graph, str(root / "two.json"), FIRST, str(root / "first"),
                    checkpoint_dir=resume.checkpoint_dir)
    _world(write_jobs([first], root / "first.json"), 2)
    output = _world(write_jobs([resume], root / "resume.json"), 3)
    # Without the resume, 10 fresh steps would match the reference too: each rank must say it resumed.
    assert output.count(f"resumed from {resume.checkpoint_dir} at step {FIRST}") == 3, output
    return root, resume, graph, keys


def test_a_tied_hf_model_resumes_on_another_partition_like_one_uninterrupted_process(resumed) -> None:
    _, job, graph, keys = resumed
    want = reference_state(job, graph)
    covered: set[str] = set()
    copies: dict[int, torch.Tensor] = {}
    for rank in range(3):
        saved = torch.load(Path(job.out) / f"rank{rank}.pt", weights_only=True)["state"]
        for key, value in saved.items():
            if key not in want:
                continue  # a buffer the original model keeps elsewhere (none are trained)
            assert_relatively_close(value, want[key], TOL, f"rank {rank} {key}")
            covered.add(key)
            if key in keys:
                copies[rank] = value
    assert covered == set(want), f"no rank holds {sorted(set(want) - covered)}"
    assert sorted(copies) == [0, 2], f"the tie ({sorted(keys)}) is held by ranks {sorted(copies)}, not 0 and 2"
    assert torch.equal(copies[0], copies[2]), "the tied copies differ across ranks"


def test_the_checkpoint_stores_the_tied_tensor_once(resumed) -> None:
    root, job, _, keys = resumed
    checkpoint = load_checkpoint(root / "checkpoints")
    assert checkpoint.extra["next_step"] == job.steps and checkpoint.world["world_size"] == 3
    stored = keys & {*checkpoint.param_names, *checkpoint.buffer_names}
    assert len(stored) == 1, f"the tie {sorted(keys)} is stored as {sorted(stored)}"
    assert keys & set(checkpoint.optimizer_state()) == stored  # its momentum once too
    first = load_checkpoint(root / "checkpoints", step=list_checkpoints(root / "checkpoints")[0])  # on 2 processes
    assert first.world["world_size"] == 2 and first.extra["next_step"] == FIRST
    assert keys & {*first.param_names, *first.buffer_names} == stored
