"""Follow one step: a forward send from `PipelineTrainer.train` passes through at most 5 project modules
(issue #34; docs/ARCHITECTURE.md's walk names them). Measured on a 2-rank gloo world by
tests/support/send_path_worker.py: the modules on the call stack when the message goes on the wire, plus
the ones handed the activation on the way (those that build the message)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import free_port, launch

WORKER = Path(__file__).parents[1] / "support" / "send_path_worker.py"
MAX_MODULES = 5


@pytest.mark.slow
def test_a_forward_send_passes_at_most_five_project_modules(tmp_path: Path) -> None:
    port = free_port()
    result = launch([[sys.executable, str(WORKER), str(rank), "2", str(port), str(tmp_path)] for rank in range(2)],
                    timeout=240)
    assert result.ok, result.summary()
    found = json.loads((tmp_path / "send_path.json").read_text())
    chain, handlers = found["chain"], found["handlers"]
    # The measurement saw the send it is about: it starts at the API and reaches the wire.
    assert chain and chain[0] == "model_parallel.api.trainer", found
    assert any(m.startswith("model_parallel.runtime.wire.") for m in chain), found
    assert "model_parallel.runtime.step.executor" in handlers, found  # the activation was seen leaving the stage
    passed = list(dict.fromkeys(chain + handlers))
    assert len(passed) <= MAX_MODULES, (
        f"a forward send passes {len(passed)} project modules (at most {MAX_MODULES}): {passed}; "
        f"on the stack at the send: {' -> '.join(chain)}; handed the activation: {handlers}")
