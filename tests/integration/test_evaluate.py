"""`evaluate`: a forward-only pipeline (no backward, no update) equals single-process evaluation of the same
trained model, in one process and on 2 and 4 processes (a tiny Hugging Face GPT-2, our TinyGPT and MLP)."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from model_parallel import PipelineTrainer
from model_parallel.errors import ConfigError
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.step.evaluate import single_process_evaluate
from model_parallel.runtime.trainer import single_process_reference
from support.eval_cases import EVAL_STEPS, STEPS, case_names, make_case

WORKER = Path(__file__).parents[1] / "support" / "eval_worker.py"


def _reference(name: str) -> dict:
    case = make_case(name)
    single_process_reference(case.model, case.loss, case.sgd, case.train_data, case.config, STEPS)
    result = single_process_evaluate(case.model, case.loss, case.eval_data, case.config.num_microbatches, EVAL_STEPS,
                                     case.metric)
    return {"loss": result.loss, "metric": result.metric}


@pytest.mark.parametrize("name", case_names())
def test_single_process_pipeline_evaluates_as_the_model(name):
    case = make_case(name)
    trainer = PipelineTrainer(case.model, case.sgd, case.train_data, case.config, criterion=case.loss, num_stages=3,
                              example_inputs=case.example, single_process=True)
    trainer.train(STEPS)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    result = trainer.evaluate(case.eval_data, EVAL_STEPS, metric=case.metric)
    want = _reference(name)
    assert result.loss == pytest.approx(want["loss"], abs=1e-5)
    assert result.metric == pytest.approx(want["metric"], abs=1e-6)
    after = trainer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "evaluate changed a parameter"
    assert all(s.training for s in trainer.runner.stages), "stages left in eval mode"
    assert trainer.evaluate(case.eval_data, 1).metric is None


def test_evaluate_refuses_no_steps():
    case = make_case("mlp")
    trainer = PipelineTrainer(copy.deepcopy(case.model), case.sgd, case.train_data, case.config, criterion=case.loss,
                              num_stages=2, example_inputs=case.example, single_process=True)
    with pytest.raises(ConfigError, match=r"evaluation steps must be >= 1.*got 0"):
        trainer.evaluate(case.eval_data, 0)


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 4))
def test_pipeline_evaluate_matches_single_process(tmp_path, world):
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), str(world), str(port), str(tmp_path)] for rank in range(world)],
                    timeout=400)
    assert result.ok, result.summary()
    got = json.loads((tmp_path / f"world{world}.json").read_text())
    for name in case_names():
        want = _reference(name)
        assert got[name]["loss"] == pytest.approx(want["loss"], abs=1e-5), name
        assert got[name]["metric"] == pytest.approx(want["metric"], abs=1e-6), name
    import model_parallel  # noqa: F401  (before transformers: repairs its torchvision import on CPU-only torch)
    import transformers

    _, info = transformers.AutoModelForCausalLM.from_pretrained(got["gpt2"]["saved_after_close"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # close() lets go of the trainer's process groups, so destroy_process_group frees them there and then (gloo has
    # no shutdown: before, they outlived it into interpreter teardown); the default group's loop is torch's to keep.
    for rank in range(world):
        teardown = json.loads((tmp_path / f"teardown{world}_{rank}.json").read_text())
        assert teardown["loops_before_destroy"] >= 2 and teardown["loops_after_destroy"] <= 1, (rank, teardown)
        assert "this trainer was closed" in teardown["train_after_close"], (rank, teardown)


def test_report_and_plot_show_the_validation_loss(tmp_path):
    from model_parallel.cli.report import plot_throughput, validation_losses

    records = [{"step": 3, "val_loss": 2.0, "rank": 0}, {"step": 3, "val_loss": 2.0, "rank": 1}, {"step": 4},
               {"step": 7, "val_loss": 1.5}]
    validation = validation_losses(records)
    assert validation == [(3, 2.0), (7, 1.5)]
    rows = [{"step": s, "samples_per_s": 10.0 + s, "plan_version": 0} for s in range(8)]
    path = plot_throughput(rows, 2, tmp_path / "throughput.png", validation)
    assert path.stat().st_size > 0


def test_eval_every_validates_in_single_process_mode_too():
    from model_parallel import RunOptions

    case = make_case("mlp")
    trainer = PipelineTrainer(case.model, case.sgd, case.train_data, case.config, criterion=case.loss, num_stages=2,
                              example_inputs=case.example, single_process=True, eval_data=case.eval_data,
                              options=RunOptions(eval_every=2, eval_steps=1))
    results = trainer.train(5)
    assert [r.step for r in results if "val_loss" in r.extra] == [1, 3, 4]
    assert results[-1].extra["val_loss"] == pytest.approx(trainer.evaluate(case.eval_data, 1).loss, abs=1e-7)
