"""Every data adapter on 2 processes: trained, checkpointed mid-epoch and resumed, it ends where the uninterrupted
run ends and where single-process training ends (params within 1e-5); a Hugging Face GPT-2 reads a map-style
dataset through a dict collate."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from model_parallel.runtime.data.sources import as_source
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.trainer import single_process_reference
from support.resume_cases import STEPS, case_names, make_case

pytestmark = [pytest.mark.slow]
WORKER = Path(__file__).parents[1] / "support" / "resume_worker.py"
WORLD = 2


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume")
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), str(WORLD), str(port), str(out)] for rank in range(WORLD)],
                    timeout=500, env={"HOME": str(out), "XDG_CACHE_HOME": str(out)})
    assert result.ok, result.summary()
    return out


@pytest.mark.parametrize("name", case_names())
def test_resume_mid_epoch_equals_uninterrupted_and_single_process(world_dir, name):
    case = make_case(name)
    source = as_source(case.data, case.config.batch_size, case.config.seed, case.collate)
    initial = {k: v.detach().clone() for k, v in case.model.named_parameters()}
    single_process_reference(case.model, case.loss, case.sgd, source, case.config, STEPS)
    want = {k: v.detach() for k, v in case.model.named_parameters()}
    got = [torch.load(world_dir / f"{name}-rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    for run in ("whole", "resumed"):
        params = {k: v for part in got for k, v in part[run].items() if k in want}
        assert params, f"{name} {run}: no parameter came back"
        for key in set(want) - set(params):  # a name no node reads stays untrained in both
            assert torch.equal(want[key], initial[key]), f"{name} {run}: {key} trained in the reference, no stage holds it"
        for key, value in params.items():
            assert torch.allclose(value, want[key], atol=1e-5), f"{name} {run}: {key} differs"
