"""`PipelineTrainer.train` called again continues where the last call ended (the next minibatches, the lr schedule
going on) on 2 processes: train(2) twice equals train(4), with and without a checkpoint directory and resume; before,
each call started at step 0 again and retrained the first minibatches without a word."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from model_parallel.runtime.launch import free_port, launch

WORKER = Path(__file__).parents[1] / "support" / "train_calls_worker.py"


@pytest.mark.slow
def test_a_second_train_call_continues_on_two_processes(tmp_path):
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), "2", str(port), str(tmp_path)] for rank in range(2)],
                    timeout=300)
    assert result.ok, result.summary()
    steps = json.loads((tmp_path / "steps.json").read_text())
    warned = steps.pop("warned")
    assert steps == {"once": [0, 1, 2, 3], "twice": [0, 1, 2, 3], "twice_resume": [0, 1, 2, 3],
                     # a first train(2) after a resume at step 4 trains nothing: said once (before, silently, and a
                     # loop of train(k) calls then ran past its total); train(0) then a loop on next_step reaches it
                     "resumed_chunk": [], "warned_chunk": [1], "resumed_loop": [4, 5]}
    assert len(warned) == 1 and "resumed at step 4, which train(2) had already reached" in warned[0]
    states = torch.load(tmp_path / "states.pt", weights_only=True)
    for name in ("twice", "twice_resume"):
        assert states[name].keys() == states["once"].keys()
        for key, value in states["once"].items():
            assert torch.equal(states[name][key], value), (name, key)
