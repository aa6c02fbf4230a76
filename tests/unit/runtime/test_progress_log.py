"""A long run's progress bar into a log file (stderr not a terminal, as under nohup, a job scheduler or
`> worker.log 2>&1`): before, `set_postfix` redrew it every step, a ~120-byte record each, never overwritten:
95 % of a worker's log, 0.5 MB per 4,000 steps and growing with the run. It is redrawn at most once per
`StepLog`'s interval there (and every 0.1 s at most on a terminal)."""
from __future__ import annotations

import io
import sys

import pytest

from model_parallel.runtime.config import RunOptions
from tests.support.one_rank import mlp_engine, one_rank_world


def test_a_bar_into_a_file_is_not_redrawn_every_step(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()  # not a terminal: isatty() is False
    monkeypatch.setattr(sys, "stderr", log)
    steps = 300
    with one_rank_world(tmp_path):
        engine = mlp_engine(RunOptions(progress=True))
        assert len(engine.train(steps)) == steps
    redraws = log.getvalue().count("train:")
    # the first draw, the last (close), and one per 10 s of a run that takes a few: far fewer than one per step
    assert 1 <= redraws <= 20, redraws
    assert f"{steps}/{steps}" in log.getvalue()  # the final state is shown
