"""cli/recover_hooks.py without processes: which steps the test hook names, and that unset it arms nothing."""
from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

import pytest

from model_parallel.cli import recover_hooks
from model_parallel.cli.recover_hooks import (AT_RECOVERY, AT_REFORM, AT_SWITCH, SIGNAL_ENV, arm_signal_hook,
                                              signal_at_recovery, signal_at_reform, signal_hook, worker_hook)


def test_the_signal_hook_names_original_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIGNAL_ENV, "1:3:KILL,2:7:STOP,1:9:STOP,2:recovery:KILL,3:switch:KILL")
    assert signal_hook(1) == {3: signal.SIGKILL, 9: signal.SIGSTOP}
    assert signal_hook(2) == {7: signal.SIGSTOP, AT_RECOVERY: signal.SIGKILL}
    assert signal_hook(3) == {AT_SWITCH: signal.SIGKILL}
    assert signal_hook(0) == {}


def _engine() -> Any:
    step = lambda step: f"ran {step}"  # noqa: E731
    apply = lambda command: True  # noqa: E731
    return SimpleNamespace(train_step=step, apply=apply, prepare=None)


def test_unset_arms_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SIGNAL_ENV, raising=False)
    assert worker_hook(0) is None
    assert signal_at_reform(0, 0) is None
    engine = _engine()
    step, apply = engine.train_step, engine.apply
    arm_signal_hook(engine, 0, 0)
    signal_at_recovery(0, 0)  # no signal: the test process goes on
    assert engine.train_step is step and engine.apply is apply


def test_another_ranks_steps_leave_this_engine_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIGNAL_ENV, "1:3:KILL,1:recovery:KILL,1:switch:KILL")
    hook = worker_hook(0)
    assert hook is not None
    engine = _engine()
    step, apply = engine.train_step, engine.apply
    hook(engine)
    signal_at_recovery(0, 0)
    assert engine.train_step is step and engine.apply is apply


def test_a_named_step_wraps_the_step_and_other_steps_run_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIGNAL_ENV, "0:5:STOP,0:recovery:KILL")
    engine = _engine()
    step = engine.train_step
    arm_signal_hook(engine, 0, 0)
    assert engine.train_step is not step  # step 5 is armed; `recovery` is not this hook's
    assert engine.train_step(4) == "ran 4"


def test_the_reform_step_signals_once_as_a_membership_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIGNAL_ENV, "1:5:KILL,2:reform:STOP")
    assert signal_hook(2) == {AT_REFORM: signal.SIGSTOP}
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(recover_hooks.os, "kill", lambda pid, number: sent.append((pid, number)))
    monkeypatch.setattr(recover_hooks, "_FIRED", set())
    assert signal_at_reform(1, 0) is None  # another rank's process: nothing (and reform waits for nobody)
    closed = signal_at_reform(2, 1)
    assert closed is not None
    closed(1)
    closed(2)  # a stopped one that continues and meets again is not stopped again
    assert [number for _, number in sent] == [signal.SIGSTOP]
    engine = _engine()
    step = engine.train_step
    arm_signal_hook(engine, 2, 1)  # `reform` is not a step of the engine's
    assert engine.train_step is step
