"""A worker under --recover that leaves names what it came through: failures survived and workers admitted apart
(it read "after surviving 2 failure(s)" for one recovery and one admission, calling the admission a failure); an
admission that lost a member on the way counts as both."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from model_parallel.cli import worker_recover
from model_parallel.cli.worker_join import JoinRecord
from model_parallel.cli.worker_recover import RecoveryRecord, Survivor


def _recovery() -> RecoveryRecord:
    return RecoveryRecord(0, 1, (2,), (0, 1), "h:1", "ck", 4, 5, 5, 1.0)


def _admission(lost: tuple[int, ...] = ()) -> JoinRecord:
    return JoinRecord(0, 2, 3, "h:2", (0, 1, 3), "h:3", 6, 7, 0.5, lost)


def _left_with(records: list[Any], monkeypatch: pytest.MonkeyPatch) -> str:
    said: list[str] = []
    monkeypatch.setattr(worker_recover, "leave", lambda code, line, *args, **kwargs: said.append(line))
    survivor = Survivor.__new__(Survivor)  # only what _leave reads
    survivor.records, survivor.world, survivor.health = records, SimpleNamespace(rank=0), None
    survivor._leave(3, "[rank 0] error: lost", None)
    return said[0]


def test_failures_and_admissions_are_counted_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    line = _left_with([_recovery(), _admission()], monkeypatch)
    assert "after surviving 1 failure(s): " in line and line.endswith("; admitting 1 joining worker(s))")
    assert "recovery 1: lost original rank(s) [2]" in line and "admission 2" not in line


def test_an_admission_that_lost_a_member_is_a_failure_too(monkeypatch: pytest.MonkeyPatch) -> None:
    line = _left_with([_admission(lost=(1,))], monkeypatch)
    assert "after surviving 1 failure(s): " in line and "lost original rank(s) [1] while the world re-formed" in line
    assert line.endswith("; admitting 1 joining worker(s))")
    assert _left_with([], monkeypatch) == "[rank 0] error: lost"
