"""The helpers' Protocols (loop, evaluate, checkpoint, migration, multi-stage build) name members `PipelineEngine` really has."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from model_parallel.runtime import engine as engine_module
from model_parallel.runtime.checkpoint.commit import AgreeingEngine, CheckpointingEngine
from model_parallel.runtime.checkpoint.live import LiveEngine
from model_parallel.runtime.checkpoint.resume import RestoringEngine, StartingEngine
from model_parallel.runtime.engine import PipelineEngine
from model_parallel.runtime.step.evaluate import EvaluatingEngine
from model_parallel.runtime.step.loop import LoopingEngine, SteppingEngine
from model_parallel.runtime.step.multi_stage import BuildingEngine
from model_parallel.runtime.wire.migration import MigratingEngine, SwitchingEngine

PROTOCOLS = [AgreeingEngine, CheckpointingEngine, RestoringEngine, StartingEngine, EvaluatingEngine, LoopingEngine,
             SteppingEngine, MigratingEngine, SwitchingEngine, LiveEngine, BuildingEngine]
_PROTOCOL_NOISE = {"_is_protocol", "_is_runtime_protocol", "_abc_impl"}


def members(protocol: type) -> set[str]:
    """The names a Protocol declares, its bases' included (typing.get_protocol_members is 3.13+)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object,) or cls.__module__ == "typing":
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {n for n in vars(cls) if not n.startswith("__") and n not in _PROTOCOL_NOISE}
    return names


def instance_attributes() -> set[str]:
    """Every `self.X = ...` (plain, tuple or annotated) written in engine.py."""
    tree = ast.parse(Path(engine_module.__file__).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and element.value.id == "self":
                    found.add(element.attr)
    return found


def test_members_are_collected_from_a_protocol_and_its_bases() -> None:
    assert {"rank", "world_size", "control_group", "timeout", "diagnose"} <= members(CheckpointingEngine)
    assert {"check_tied", "fingerprint", "replica"} <= members(RestoringEngine)


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_pipeline_engine_has_every_member_a_helper_protocol_names(protocol: type) -> None:
    have = instance_attributes() | {n for n in dir(PipelineEngine) if not n.startswith("__")}
    missing = sorted(members(protocol) - have)
    assert not missing, f"{protocol.__name__} names {missing}, which PipelineEngine does not have"


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_protocol_methods_take_the_engine_methods_parameters(protocol: type) -> None:
    for name in sorted(members(protocol)):
        declared = inspect.getattr_static(protocol, name, None)
        if not inspect.isfunction(declared):
            continue
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(getattr(PipelineEngine, name)).parameters)
        assert got[:len(want)] == want, f"{protocol.__name__}.{name}{want} vs PipelineEngine.{name}{got}"


def test_no_helper_reaches_into_the_engine_with_a_private_name() -> None:
    runtime = Path(engine_module.__file__).parent
    for path in sorted(runtime.rglob("*.py")):
        if path.name == "engine.py":
            continue
        text = path.read_text()
        assert "engine._" not in text, f"{path.relative_to(runtime)} reaches into a private member of the engine"
