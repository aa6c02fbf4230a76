"""A switch that names a schedule (`Command.schedule`, --schedule auto chosen again): `apply_switch` runs the new plan
under it once the switch commits, and every way it does not commit leaves the running schedule in place."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from model_parallel.errors import PeerError, SwitchRolledBack
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import Command
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.observe.tracing import Tracer
from model_parallel.runtime.wire import migration


def engine(config: TrainConfig) -> Any:
    nodes = (Node("x", "Input0"), Node("a", "Linear(0)", forward_ms=1.0), Node("b", "Linear(1)", forward_ms=1.0))
    graph = Graph(nodes, (("x", "a"), ("a", "b")))
    plan = Plan((StagePlan(0, ("x", "a"), ranks=(0,)), StagePlan(1, ("b",), ranks=(1,))))
    told: list[tuple[str, int]] = []
    channel = SimpleNamespace(schedule=config.schedule, switch_refused=lambda v, why: told.append(("refused", v)),
                              switch_failed=lambda v, failures: told.append(("failed", v)))
    return SimpleNamespace(graph=graph, plan=plan, config=config, world_size=2, modules=None, rank=0, prefix="[rank 0]",
                           channel=channel, tracer=Tracer(0, enabled=False), switch_pauses_ms=[], told=told)


def switch(eng: Any, schedule: str) -> Command:
    return Command.switch(Plan(eng.plan.stages, version=1), "test", schedule=schedule)


def test_a_committed_switch_runs_the_schedule_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine(TrainConfig(schedule="1f1b", schedule_auto=True))
    seen = []
    monkeypatch.setattr(migration, "switch_plan", lambda e, plan: seen.append(e.config.schedule) or 0.01)
    assert migration.apply_switch(eng, switch(eng, "zbh1")) == 0.01
    assert seen == ["zbh1"]  # the new stage is built under it (prepare reads engine.config)
    assert eng.config == TrainConfig(schedule="zbh1", schedule_auto=True) and eng.channel.schedule == "zbh1"


def test_a_rolled_back_switch_keeps_the_running_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine(TrainConfig(schedule="1f1b", schedule_auto=True))

    def fail(e: Any, plan: Plan) -> float:
        raise SwitchRolledBack("the switch to plan v1 failed on rank 1: MemoryError", {1: "MemoryError"}, 0.02)
    monkeypatch.setattr(migration, "switch_plan", fail)
    assert migration.apply_switch(eng, switch(eng, "gpipe")) == 0.02
    assert eng.config.schedule == "1f1b" and eng.channel.schedule == "1f1b" and eng.told == [("failed", 1)]

    def dead(e: Any, plan: Plan) -> float:
        raise PeerError("rank 1 stopped responding")
    monkeypatch.setattr(migration, "switch_plan", dead)
    with pytest.raises(PeerError):
        migration.apply_switch(eng, switch(eng, "gpipe"))
    assert eng.config.schedule == "1f1b"


def test_a_fixed_schedule_refuses_a_switch_that_names_another(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine(TrainConfig(schedule="1f1b"))
    monkeypatch.setattr(migration, "switch_plan", lambda e, plan: pytest.fail("nothing may move"))
    assert migration.apply_switch(eng, switch(eng, "zbh1")) == 0.0
    assert eng.config == TrainConfig(schedule="1f1b") and eng.told == [("refused", 1)]
    # A schedule whose placement the plan lacks is refused before anything moves, the running one kept.
    auto = engine(TrainConfig(schedule="1f1b", schedule_auto=True))
    monkeypatch.setattr(migration, "switch_plan", lambda e, plan: pytest.fail("nothing may move"))
    assert migration.apply_switch(auto, switch(auto, "interleaved")) == 0.0
    assert auto.config.schedule == "1f1b" and auto.told == [("refused", 1)]
