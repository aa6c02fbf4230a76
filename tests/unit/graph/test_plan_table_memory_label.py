"""The plan table's memory column says which estimate it is: under PipeDream's default memory model the last stage
read "0.0" MB (its formula counts copies stashed for the stages downstream), unlabelled, beside 30 MB of weights."""
from __future__ import annotations

from model_parallel.graph.plan import Plan, StagePlan


def _plan(model: str) -> Plan:
    stages = (StagePlan(0, ("a",), ranks=(0,), memory_bytes=14e6), StagePlan(1, ("b",), ranks=(1,), memory_bytes=0.0))
    return Plan(stages, extra={"memory_model": model})


def test_a_legacy_memory_estimate_is_named_under_the_table():
    lines = _plan("pipedream").table().splitlines()
    assert any(line.startswith("memory MB: PipeDream's estimate") and "the last stage 0" in line for line in lines)
    assert any(line.startswith("memory MB: the 1f1b estimate") for line in _plan("1f1b").table().splitlines())


def test_the_footprint_needs_no_note():
    assert "memory MB:" not in _plan("footprint").table()
