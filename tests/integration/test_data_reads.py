"""Only stage 0 and the last stage read data, and no target travels between stages (issue #35): 4 processes, the
MLP on 3 stages with the last replicated on 2 ranks, trained and validated on a dataset that records its readers;
the run still equals single-process training and validation."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from model_parallel.codegen.naming import state_key
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.step.evaluate import single_process_evaluate
from model_parallel.runtime.trainer import single_process_reference
from support.data_reads import BATCH, CONFIG, EVAL_SEED, EVAL_STEPS, STEPS, sgd
from support.mlp import assert_params_close

pytestmark = [pytest.mark.slow]
WORKER = Path(__file__).parents[1] / "support" / "data_reads_worker.py"
WORLD = 4


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data_reads")
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), str(WORLD), str(port), str(out)] for rank in range(WORLD)],
                    timeout=300, env={"HOME": str(out), "XDG_CACHE_HOME": str(out)})
    assert result.ok, result.summary()
    return out


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_only_stage_0_reads_inputs_and_only_the_last_stage_reads_targets(world_dir: Path) -> None:
    ranks = _ranks(world_dir)
    assert [r["stage"] for r in ranks] == [0, 1, 2, 2]
    # The training data's fingerprint (checkpoint/data_identity.py: batch(0), read twice) is read by every rank as
    # its engine is built, for the same-data check and the checkpoint record; the steps are read as below.
    fingerprint = {"train_calls": [["batch", 0]] * 2, "eval_calls": []}
    for calls, steps in (("train_calls", STEPS), ("eval_calls", EVAL_STEPS)):
        assert ranks[0][calls] == fingerprint[calls] + [["batch", s] for s in range(steps)], calls
        assert ranks[1][calls] == fingerprint[calls], f"the intermediate stage read data ({calls})"
        # Each replica of the last stage reads the step's targets; once per source, batch(0) checks targets(0).
        want = fingerprint[calls] + [["targets", 0], ["batch", 0]] + [["targets", s] for s in range(1, steps)]
        for replica in ranks[2:]:
            assert replica[calls] == want, calls


def test_activation_messages_carry_the_stage_outputs_and_no_target(world_dir: Path) -> None:
    ranks = _ranks(world_dir)
    micro = CONFIG.num_microbatches
    for r in ranks[:2]:
        # One message per microbatch of every training and validation step, to the next stage.
        assert len(r["sent"]) == micro * (STEPS + EVAL_STEPS), r["stage"]
        for message in r["sent"]:
            # The MLP's boundaries are float activations of one microbatch; the int64 class target is not sent.
            assert len(message["dtypes"]) == len(r["outputs"]), message
            assert set(message["dtypes"]) == {"torch.float32"}, message
            assert all(shape[0] == BATCH // micro for shape in message["shapes"]), message
    # Microbatch j goes to replica j % 2 of the last stage.
    assert sorted({m["dst"] for m in ranks[1]["sent"]}) == [2, 3]
    assert ranks[2]["sent"] == [] and ranks[3]["sent"] == []


def test_the_run_equals_single_process_training_and_validation(world_dir: Path) -> None:
    r = recipe("mlp")
    model = r.model(0)
    single_process_reference(model, r.criterion, sgd, r.data(BATCH, CONFIG.seed), CONFIG, STEPS)
    want = {state_key(k): v.detach() for k, v in model.named_parameters()}
    states = [torch.load(world_dir / f"state-rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    assert sorted(states[2]) == sorted(states[3]) and all(torch.equal(states[2][k], states[3][k]) for k in states[2])
    assert_params_close({k: v for state in states[:3] for k, v in state.items()}, want, "3 stages, last replicated")
    loss = single_process_evaluate(model, r.criterion, r.data(BATCH, EVAL_SEED), CONFIG.num_microbatches, EVAL_STEPS).loss
    for rank in _ranks(world_dir):
        assert rank["loss"] == pytest.approx(loss, rel=1e-5)
