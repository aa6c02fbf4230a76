"""Dropout's masks are keyed by (seed, step, stage, microbatch) (runtime/step/rng.py): a model with dropout trains
on 2 processes exactly as the single-process runner trains the same plan, under 1F1B and ZBV (whose stages sit
on ranks in a V), where before each process drew from its own random stream; and training leaves the process's
own random stream alone."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from model_parallel import PipelineTrainer
from model_parallel.graph.plan import Plan
from model_parallel.runtime.launch import free_port, launch
from support.dropout_case import SCHEDULES, STEPS, Tokens, build, config, sgd

WORKER = Path(__file__).parents[1] / "support" / "dropout_worker.py"


@pytest.mark.slow
def test_a_model_with_dropout_trains_as_in_one_process(tmp_path):
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), "2", str(port), str(tmp_path)] for rank in range(2)],
                    timeout=400)
    assert result.ok, result.summary()
    from safetensors.torch import load_file

    got = load_file(tmp_path / "rank0.safetensors")
    for schedule in SCHEDULES:
        plan = Plan.from_dict(json.loads((tmp_path / f"plan_{schedule}.json").read_text()))
        trainer = PipelineTrainer(build(), sgd, Tokens(), config(schedule), plan=plan, single_process=True)
        before = torch.get_rng_state()
        losses = [r.loss for r in trainer.train(STEPS)]
        assert torch.equal(torch.get_rng_state(), before), "training drew from the process's random stream"
        assert losses == pytest.approx(got[f"{schedule}/losses"].tolist(), abs=1e-6), schedule
        state = trainer.state_dict()
        mine = {k.partition("/")[2]: v for k, v in got.items() if k.startswith(f"{schedule}/") and not k.endswith("losses")}
        assert mine, schedule
        for key, value in mine.items():
            assert torch.allclose(value, state[key], rtol=0, atol=1e-6), (schedule, key)
