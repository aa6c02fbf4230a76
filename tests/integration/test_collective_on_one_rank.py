"""`trainer.save_pretrained(...)` and `trainer.state_dict(original_names=True)` are collectives: called on rank 0 only
(as one writes a file), rank 0 failed with a bare `PeerError: ... Connection closed by peer`. The error now says the
call is collective and every rank must make it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import free_port, launch

WORKER = Path(__file__).parents[1] / "support" / "rank0_only_worker.py"
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.parametrize("what, call", [("save", "save_pretrained"), ("state", "state_dict(original_names=True)")])
def test_a_collective_called_on_rank_0_only_says_it_is_collective(tmp_path, what, call):
    port = free_port()
    launch([[sys.executable, str(WORKER), str(rank), "2", str(port), str(tmp_path), what] for rank in range(2)],
           timeout=200)  # rank 0's exit code is its teardown's after a lost peer: what it raised is the result
    raised = json.loads((tmp_path / f"{what}.json").read_text())
    assert raised["type"] == "PeerError", raised
    assert raised["message"].startswith(f"{call}: "), raised
    assert raised["message"].endswith(f"({call} is collective: call it on every rank, together)"), raised
    assert not (tmp_path / "saved").exists()
