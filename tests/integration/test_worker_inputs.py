"""The worker command line trains models given as files: a graph.json (`--graph`) and a package that
PipeDream's own converter generated (`--package`, no graph.json inside), matching single-process training."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import launch_workers
from support.mlp import assert_params_close, mlp_job, reference_params

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
TRAIN = ["--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01", "--timeout", "30"]


def test_stacked_mlp_trains_from_graph_json(tmp_path: Path) -> None:
    # `--model mlp` is a StackedMLP (an nn.Sequential: layer targets "0", "2", ...); from its graph.json
    # the worker rebuilds it with the same seed, so the result must equal single-process training.
    graph, plan = mlp_job(tmp_path, 2)
    steps = 3
    result = launch_workers(["--graph", str(graph), "--plan", str(plan), "--steps", str(steps),
                             "--checkpoint_dir", str(tmp_path / "ck"), *TRAIN], 2, timeout=150)
    assert result.ok, result.summary()
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "--graph StackedMLP run")


# ---- a package as PipeDream's convert_graph_to_model.py writes it ---------------------------------------
PIPEDREAM_PACKAGE = {
    "stage0.py": """
        import torch


        class Stage0(torch.nn.Module):
            def __init__(self):
                super(Stage0, self).__init__()
                self.layer2 = torch.nn.Linear(in_features=16, out_features=32, bias=True)
                self.layer3 = torch.nn.ReLU(inplace=True)

            def forward(self, input0):
                out0 = input0.clone()
                out2 = self.layer2(out0)
                out3 = self.layer3(out2)
                return out3
    """,
    "stage1.py": """
        import torch


        class Stage1(torch.nn.Module):
            def __init__(self):
                super(Stage1, self).__init__()
                self.layer4 = torch.nn.Linear(in_features=32, out_features=4, bias=True)

            def forward(self, input0):
                out0 = input0.clone()
                out4 = self.layer4(out0)
                return out4
    """,
    "__init__.py": """
        from .stage0 import Stage0
        from .stage1 import Stage1


        def arch():
            return "tiny"


        def model(criterion):
            return [
                (Stage0(), ["input0"], ["out0"]),
                (Stage1(), ["out0"], ["out1"]),
                (criterion, ["out1"], ["loss"]),
            ]


        def full_model():
            import torch
            return torch.nn.Sequential(Stage0(), Stage1())
    """,
}


def write_pipedream_package(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name, text in PIPEDREAM_PACKAGE.items():
        (directory / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    conf = {"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}}
    (directory / "mp_conf.json").write_text(json.dumps(conf), encoding="utf-8")
    (directory / "hybrid_conf.json").write_text(json.dumps(conf), encoding="utf-8")
    return directory


def single_process_params(package: Path, steps: int, shape: tuple[int, ...], classes: int) -> dict[str, torch.Tensor]:
    from model_parallel.runtime.build.pipedream import load_pipedream_package
    from model_parallel.runtime.config import TrainConfig
    from model_parallel.runtime.data.batches import make_dataset
    from model_parallel.runtime.trainer import single_process_reference

    job = load_pipedream_package(package, seed=0, input_shape=shape)
    config = TrainConfig(batch_size=8, num_microbatches=4)
    single_process_reference(job.model, torch.nn.functional.cross_entropy,
                             lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                             make_dataset("synthetic", 8, 0, shape=shape, num_classes=classes, kind="dense"), config, steps)
    return {name: value.detach() for name, value in job.model.named_parameters()}


def test_pipedream_generated_package_trains_like_one_process(tmp_path: Path) -> None:
    package = write_pipedream_package(tmp_path / "tiny_pkg")
    steps = 3
    result = launch_workers(["--package", str(package), "--input_shape", "16", "--num_classes", "4", "--steps", str(steps),
                             "--checkpoint_dir", str(tmp_path / "ck"), *TRAIN], 2, timeout=150)
    assert result.ok, result.summary()
    assert "PipeDream package" in result.output(0)
    got = load_checkpoint(tmp_path / "ck").params()
    assert_params_close(got, single_process_params(package, steps, (16,), 4), "PipeDream package run")


def test_pipedream_package_refuses_a_live_plan_switch_and_trains_on(tmp_path: Path) -> None:
    package = write_pipedream_package(tmp_path / "tiny_pkg")
    script = tmp_path / "control.json"
    any_plan = Plan(stages=(StagePlan(stage_id=0, node_ids=("x",)),)).to_dict()  # refused before it is looked at
    script.write_text(json.dumps({"1": {"kind": "switch", "plan": any_plan}}), encoding="utf-8")
    result = launch_workers(["--package", str(package), "--input_shape", "16", "--steps", "3",
                             "--control_script", str(script), *TRAIN], 2, timeout=150)
    assert result.ok, result.summary()  # refused, not fatal: training goes on with the static plan
    assert "refusing the live plan switch" in result.output(0) and "needs graph.json" in result.output(0), result.summary()
    assert "Traceback" not in result.output(0), result.output(0)[-3000:]
