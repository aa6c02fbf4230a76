"""The one job builder (model_parallel.api.job): the worker command line and `PipelineTrainer` build the
same job from the same model, and a `JobSpec` that cannot work is refused before anything is built."""
from __future__ import annotations

import pytest
import torch

from model_parallel.api.job import JobSpec, build_job
from model_parallel.api.trainer import PipelineTrainer
from model_parallel.cli.worker import build_parser
from model_parallel.cli.worker_job import load_job
from model_parallel.codegen.naming import state_key
from model_parallel.errors import PlanError
from model_parallel.graph.io import save_graph
from model_parallel.runtime.build.materialize import materialize_model
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import TrainConfig


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def test_the_worker_cli_and_the_pipeline_trainer_build_the_same_job_for_the_mlp() -> None:
    seed, stages = 3, 3
    cli = load_job(build_parser().parse_args(["--model", "mlp", "--num_stages", str(stages), "--seed", str(seed),
                                              "--batch_size", "8", "--num_microbatches", "4"]), world_size=stages)
    r = recipe("mlp")
    trainer = PipelineTrainer(r.model(seed), _sgd, r.data(8, seed), TrainConfig(batch_size=8, num_microbatches=4, seed=seed),
                              criterion=r.criterion, num_stages=stages, single_process=True)

    assert [n.node_id for n in trainer.graph.nodes] == [n.node_id for n in cli.graph.nodes]
    assert trainer.graph == cli.graph
    assert trainer.plan == cli.plan and cli.plan.num_stages == stages
    # The worker builds on meta (no memory); the per-layer init rule gives it the trainer's values.
    assert all(p.is_meta for p in cli.model.parameters())
    materialize_model(cli.model, seed, cli.graph)
    expected = {name: value for name, value in cli.model.state_dict().items()}
    got = trainer.model.state_dict()
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    # The trainer's stages hold those same initial weights under their stage-module names.
    stage_state = trainer.state_dict()
    for name, value in expected.items():
        assert torch.equal(stage_state[state_key(name)], value), name
    # The data the worker builds for the zoo model is the recipe's synthetic data, step for step.
    (x_cli,), y_cli = cli.dataset.batch(1)
    (x_api,), y_api = r.data(8, seed).batch(1)
    assert torch.equal(x_cli, x_api) and torch.equal(y_cli, y_api)


def test_a_graph_file_and_the_graph_object_give_the_same_job(tmp_path) -> None:
    zoo = build_job(JobSpec(model="gpt", num_stages=2), world_size=2)
    save_graph(zoo.graph, tmp_path / "graph.json")
    from_file = build_job(JobSpec(graph=tmp_path / "graph.json", seed=1), world_size=2)
    from_object = build_job(JobSpec(graph=zoo.graph, seed=1), world_size=2)
    assert from_file.plan == from_object.plan == zoo.plan
    materialize_model(from_file.model, 1, from_file.graph)
    materialize_model(from_object.model, 1, from_object.graph)
    for (name, a), b in zip(from_file.model.state_dict().items(), from_object.model.state_dict().values()):
        assert torch.equal(a, b), name
    # Token inputs: the language-model loss and token data, as for the zoo's gpt.
    (tokens,), _ = from_file.dataset.batch(0)
    assert tokens.dtype == torch.int64 and from_file.criterion.__name__ == "lm_loss"


def test_replicas_of_the_even_split_come_out_of_the_world_size() -> None:
    job = build_job(JobSpec(model="mlp", stage_to_num_ranks={0: 2}), world_size=4)
    assert job.plan.num_stages == 3 and [s.ranks for s in job.plan.stages] == [(0, 1), (2,), (3,)]


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"JobSpec: give exactly one of model, package, graph \(got none\)"),
    ({"model": "mlp", "graph": "g.json"}, r"JobSpec: give exactly one of model, package, graph \(got model, graph\)"),
    ({"model": 3}, r"model takes a built-in model's name or an nn.Module.*got model=int"),
    ({"model": "mlp", "loss": "hinge"}, r"loss 'hinge' is unknown; use one of cross_entropy, lm"),
    ({"model": "mlp", "num_stages": 0}, r"num_stages must be >= 1, got 0"),
])
def test_a_spec_that_cannot_work_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        JobSpec(**kwargs)


def test_a_module_needs_something_to_trace_it_with() -> None:
    with pytest.raises(PlanError, match=r"JobSpec\(model=Linear\): give example_inputs .* not 'synthetic'"):
        build_job(JobSpec(model=torch.nn.Linear(4, 2)), world_size=1)
    job = build_job(JobSpec(model=torch.nn.Linear(4, 2), example_inputs=[torch.zeros(2, 4)], num_classes=2), world_size=1)
    (x,), y = job.dataset.batch(0)
    assert x.shape == (8, 4) and int(y.max()) < 2


def test_only_the_job_builder_traces_a_model_or_rebuilds_one_from_a_graph() -> None:
    """One job builder: no module outside the profiler, the code generator and the job builder's model sources
    (api/job_models.py) traces a model or rebuilds one."""
    import ast

    from support import REPO

    builders = {"trace_model", "full_model_from_graph", "load_pipedream_package"}
    owners = {"model_parallel/api/job_models.py"}
    found = set()
    for path in sorted((REPO / "model_parallel").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("model_parallel/profiler/", "model_parallel/codegen/")) or rel.endswith("runtime/build/pipedream.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and builders & {a.name for a in node.names}:
                found.add(rel)
    assert found == owners


def test_example_inputs_of_another_batch_size_are_named_before_training(caplog) -> None:
    # A Hugging Face trace records the example's batch size (GPT-2: "shape '[2, 8, 96]' is invalid for input of size
    # 3072" at the first step of microbatches of 4): the job builder says so first. Inputs that disagree on dim 0
    # (a [1, T] position_ids broadcasts) give no batch size to compare, and a microbatch-sized example no warning.
    spec = dict(model=torch.nn.Linear(4, 2), num_classes=2, batch_size=8, num_microbatches=2)
    with caplog.at_level("WARNING", logger="model_parallel.api.job_models"):
        build_job(JobSpec(example_inputs=[torch.zeros(2, 4)], **spec), world_size=1)
    assert "example_inputs hold 2 samples (dim 0) and a microbatch 4" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="model_parallel.api.job_models"):
        build_job(JobSpec(example_inputs=[torch.zeros(4, 4)], **spec), world_size=1)
    assert "example_inputs hold" not in caplog.text
    from model_parallel.api.job_models import _warn_other_batch

    with caplog.at_level("WARNING", logger="model_parallel.api.job_models"):
        _warn_other_batch({"input_ids": torch.zeros(4, 8), "position_ids": torch.zeros(1, 8)}, 4)
    assert "example_inputs hold" not in caplog.text
