"""Every plan switch's pause was kept in a list for ever and printed in full on the worker's "done" line: a run that
rebalanced all day (a noisy machine switched every ~200 steps; `ctl set-plan` in a loop, 400 in 4 minutes) ended
with a line of thousands of numbers. The engine keeps the latest HISTORY_WINDOW; the line shows the last 10."""
from __future__ import annotations

from model_parallel.runtime.config import RunOptions
from model_parallel.runtime.engine import HISTORY_WINDOW
from tests.support.one_rank import mlp_engine, one_rank_world


def test_switch_pauses_are_bounded_and_the_done_line_short(tmp_path) -> None:
    with one_rank_world(tmp_path):
        engine = mlp_engine(RunOptions(progress=False))
    for switch in range(3 * HISTORY_WINDOW):  # what each switch that went through appends (wire/migration.py)
        engine.switch_pauses_ms.append(100.0 + switch)
    assert len(engine.switch_pauses_ms) == HISTORY_WINDOW
    assert list(engine.switch_pauses_ms)[-1] == 100.0 + 3 * HISTORY_WINDOW - 1

    from model_parallel.runtime.run import _pauses

    line = _pauses(engine.switch_pauses_ms)
    assert line.startswith(f"switch pauses ms (the last 10 of {HISTORY_WINDOW}+ switches) [") and len(line) < 200, line
    assert _pauses(engine.switch_pauses_ms.__class__([12.34, 5.0])) == "switch pauses ms [12.3, 5.0]"
