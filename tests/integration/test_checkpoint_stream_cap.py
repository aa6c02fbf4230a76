"""A checkpoint and a resume of an offloaded optimizer stream its state: under an RLIMIT_DATA cap of what the
process holds plus 96 MB (a third of the 256 MB AdamW state), save_shard, finalize, load_into and the state's
restore into a second offloaded optimizer all fit and restore the state bitwise, while the whole state held at
once (what the shard writer did before streaming: one torch.save payload built in memory) is refused by the same
cap. The cap is set in a child process (tests/support/stream_cap_worker.py); the code before streaming exits 3."""
from __future__ import annotations

import os
import sys

import pytest

from support import TESTS
from support.process import run_to_completion

pytestmark = [pytest.mark.slow]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and /proc/self/status are Linux's")
def test_checkpoint_and_resume_of_offloaded_state_fit_a_cap_the_whole_state_does_not(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    output = run_to_completion([sys.executable, str(TESTS / "support" / "stream_cap_worker.py"), str(tmp_path)],
                               cwd=tmp_path, env=env, timeout=300)
    assert "control: whole state refused" in output  # the cap bites: the unstreamed path cannot fit it
    assert "streamed: cap" in output  # ... and the streamed one did, restoring parameters and state bitwise
