"""runtime/checkpoint/live.py without processes: which step a live engine's state belongs to when a failure hits."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from model_parallel.errors import PeerError
from model_parallel.runtime.checkpoint.live import StepTracker


class FakeEngine:
    """A step that may fail before or after its update, and a command whose application may fail."""

    def __init__(self, flush: bool = True) -> None:
        self.schedule = SimpleNamespace(flush=flush)
        self.updates = 0
        self.fail: str = ""

    def train_step(self, step: int) -> Any:
        if self.fail == "before update":
            raise PeerError("rank 1 stopped responding")
        self.updates += 1
        if self.fail == "after update":
            raise PeerError("rank 1 stopped responding")
        return step

    def apply(self, command: Any) -> bool:
        if self.fail == "switch":
            raise PeerError("rank 1 stopped responding")
        return True


def run(engine: FakeEngine, tracker: StepTracker, steps: int, fail: str) -> None:
    for step in range(steps):
        engine.fail = fail if step == steps - 1 and fail in ("before update", "after update") else ""
        try:
            engine.train_step(step)
        except PeerError:
            return
    engine.fail = fail
    try:
        engine.apply(object())
    except PeerError:
        return


@pytest.mark.parametrize("fail, want", [("before update", 3), ("after update", 4), ("", 4)])
def test_the_state_belongs_to_the_last_step_whose_update_it_holds(fail: str, want: int) -> None:
    engine, tracker = FakeEngine(), StepTracker()
    tracker.watch(engine)  # type: ignore[arg-type]
    run(engine, tracker, 5, fail)
    assert tracker.state_step(engine) == (want, "")  # type: ignore[arg-type]


def test_no_state_during_a_plan_switch_before_a_step_or_under_pipedream() -> None:
    engine, tracker = FakeEngine(), StepTracker()
    tracker.watch(engine)  # type: ignore[arg-type]
    assert tracker.state_step(engine) == (None, "the failure came before its first step (while building or restoring)")  # type: ignore[arg-type]
    run(engine, tracker, 2, "switch")
    assert tracker.state_step(engine) == (None, "a plan switch was under way")  # type: ignore[arg-type]
    pipedream = FakeEngine(flush=False)
    assert StepTracker().state_step(pipedream)[1].startswith("the pipedream schedule updates after every microbatch")  # type: ignore[arg-type]
