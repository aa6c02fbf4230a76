"""Fuzz what the runtime reads back: checkpoints on disk (corrupted, truncated, deleted files) and control
commands / control scripts. A reader returns the original data or raises its typed error, never garbage."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_parallel.errors import CheckpointError, ModelParallelError, ProtocolError
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, ScriptedChannel
from model_parallel.runtime.checkpoint.store import finalize, load_checkpoint, save_shard

DEEP = int(os.environ.get("MP_FUZZ_EXAMPLES", "0"))  # see test_fuzz.py
FUZZ = settings(max_examples=DEEP or 150, deadline=None, derandomize=not DEEP, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])

PARAMS = {0: {"fc0.weight": torch.arange(6.0).reshape(2, 3), "fc0.bias": torch.ones(2)},
          1: {"fc1.weight": torch.full((3, 2), 0.5)}}
OPTIMIZER = {0: {"fc0.weight": {"momentum_buffer": torch.zeros(2, 3)}}, 1: {}}


def _template(root: Path) -> dict[str, bytes]:
    """Two committed checkpoints (steps 1 and 3) of a 2-rank run, as {relative path: bytes}."""
    for step in (1, 3):
        for rank in (0, 1):
            save_shard(root, step, rank, PARAMS[rank], buffers={"bn.running_mean": torch.zeros(2)} if rank else None,
                       optimizer_state=OPTIMIZER[rank], extra={"rng": [1, 2, 3]})
        finalize(root, step, {"world_size": 2}, None, expected_ranks=[0, 1], extra={"data_step": step + 1})
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


_TEMPLATE: dict[str, bytes] = {}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    # Kept out of the hypothesis arguments so a failure report shows the corruption, not 20 kB of files.
    if not _TEMPLATE:
        _TEMPLATE.update(_template(tmp_path_factory.mktemp("checkpoint_template")))
    return _TEMPLATE


JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**400) | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


@st.composite
def corruption(draw: st.DrawFn, names: list[str]) -> tuple[str, str, Any]:
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["truncate", "flip", "delete", "garbage", "json"]))
    if kind == "truncate":
        return name, kind, draw(st.integers(0, 400))
    if kind == "flip":
        return name, kind, (draw(st.integers(0, 10_000)), draw(st.integers(1, 255)))
    if kind == "garbage":
        return name, kind, draw(st.binary(max_size=64))
    if kind == "json":
        return name, kind, draw(JSON | st.dictionaries(st.sampled_from(
            ["format", "version", "step", "model_fingerprint", "shards", "world", "params", "buffers", "rank", "file", "sha256"]),
            JSON, max_size=6))
    return name, kind, None


def _apply(root: Path, template: dict[str, bytes], change: tuple[str, str, Any]) -> None:
    for name, data in template.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    name, kind, arg = change
    path = root / name
    data = template[name]
    if kind == "truncate":
        path.write_bytes(data[: min(arg, max(0, len(data) - 1))])
    elif kind == "flip":
        index, mask = arg
        changed = bytearray(data)
        changed[index % len(changed)] ^= mask
        path.write_bytes(bytes(changed))
    elif kind == "delete":
        path.unlink()
    elif kind == "garbage":
        path.write_bytes(arg)
    else:
        path.write_text(json.dumps(arg))


def _read_everything(root: Path) -> Any:
    checkpoint = load_checkpoint(root)
    return checkpoint.step, checkpoint.params(), checkpoint.buffers(), checkpoint.optimizer_state(), checkpoint.shard_extra(0)


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_corrupted_checkpoint_reads_back_exactly_or_raises(template: None, tmp_path_factory: pytest.TempPathFactory,
                                                           data: st.DataObject) -> None:
    template = _TEMPLATE
    root = tmp_path_factory.mktemp("corrupt")
    change = data.draw(corruption(sorted(template)), label="corruption")
    _apply(root, template, change)
    try:
        step, params, buffers, optimizer, _ = _read_everything(root)
    except CheckpointError as error:
        assert str(root) in str(error), f"{change}: the message must name the file: {error}"
        return
    # Whatever loads must be the checkpoint as written (step 3, or step 1 if step 3 was not committed).
    assert step in (1, 3)
    assert sorted(params) == sorted(PARAMS[0] | PARAMS[1])
    for name, value in (PARAMS[0] | PARAMS[1]).items():
        assert torch.equal(params[name], value), f"{change}: {name} loaded with different values"
    assert torch.equal(buffers["bn.running_mean"], torch.zeros(2))
    assert torch.equal(optimizer["fc0.weight"]["momentum_buffer"], torch.zeros(2, 3))


@pytest.mark.parametrize("manifest", [
    {"format": "model_parallel.checkpoint", "version": 1, "step": 3, "model_fingerprint": "x", "shards": 5},
    {"format": "model_parallel.checkpoint", "version": 1, "step": 3, "shards": []},
    {"format": "model_parallel.checkpoint", "version": 1, "step": "three", "model_fingerprint": "x", "shards": []},
    {"format": "model_parallel.checkpoint", "version": 1, "step": 3, "model_fingerprint": "x", "shards": [{"rank": 0}]},
], ids=["shards-not-a-list", "no-fingerprint", "step-not-a-number", "shard-without-params"])
def test_malformed_manifest_is_a_checkpoint_error(template: dict[str, bytes], tmp_path: Path, manifest: dict) -> None:
    _apply(tmp_path, template, ("step_3/manifest.json", "json", manifest))
    with pytest.raises(CheckpointError, match="manifest"):
        _read_everything(tmp_path)


@pytest.mark.parametrize("text, message", [
    ('{"format": "model_parallel.checkpoint", "version": 1, "step": ' + "3" * 5000 + "}", "an integer of 5000 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
    ('{"extra": ' + "{\"a\": " * 80 + "1" + "}" * 81, "nested deeper than 64 levels at .extra.a.a"),
], ids=["huge-int", "deep-recursion", "deep"])
def test_hostile_manifest_is_a_checkpoint_error_naming_it(template: dict[str, bytes], tmp_path: Path, text: str,
                                                          message: str) -> None:
    # These escaped as ValueError (int-to-str limit) and RecursionError before the decoder was bounded.
    _apply(tmp_path, template, ("step_3/manifest.json", "garbage", text.encode()))
    with pytest.raises(CheckpointError, match=rf"step_3/manifest.json: manifest is corrupt \(.*{message}"):
        load_checkpoint(tmp_path)


def test_latest_pointer_that_is_not_text_is_a_checkpoint_error(template: dict[str, bytes], tmp_path: Path) -> None:
    _apply(tmp_path, template, ("latest", "garbage", b"\x80\xff"))
    with pytest.raises(CheckpointError, match="latest"):
        load_checkpoint(tmp_path)


# ---- control commands and scripts ---------------------------------------------------------------------
EDGE_NUMBERS = st.sampled_from([float("inf"), float("-inf"), float("nan"), 10**400, -1, 0, 1.5, True])


@pytest.mark.slow
@FUZZ
@given(JSON | st.fixed_dictionaries({"kind": st.sampled_from(["continue", "switch", "stop", "slowdown", "x"])},
                                    optional={"rank": EDGE_NUMBERS | JSON, "factor": EDGE_NUMBERS | JSON, "plan": JSON,
                                              "reason": JSON, "extra": JSON}))
def test_command_from_dict_builds_or_raises_protocol_error(data: Any) -> None:
    try:
        command = Command.from_dict(data)
    except ModelParallelError as error:
        assert isinstance(error, ProtocolError), f"{type(error).__name__}: {error}"
        return
    assert command.plan is None or isinstance(command.plan, Plan)
    assert Command.from_dict(command.to_dict()) == command


@pytest.mark.parametrize("data", [{"kind": "stop", "rank": float("inf")}, {"kind": "stop", "factor": 10**400},
                                  {"kind": "slowdown", "rank": 1, "factor": float("inf")}],
                         ids=["rank-inf", "factor-huge-int", "slowdown-forever"])
def test_command_with_infinite_numbers_is_a_protocol_error(data: dict) -> None:
    # int(inf) / float(10**400) raise OverflowError; a slowdown factor of inf would stall the slowed rank forever.
    with pytest.raises(ProtocolError):
        Command.from_dict(data)


@pytest.mark.parametrize("data", [{"kind": "slowdown", "rank": True, "factor": 2}, {"kind": "slowdown", "rank": "\u0663", "factor": 2},
                                  {"kind": "slowdown", "rank": 1e300, "factor": 2}, {"kind": "slowdown", "rank": 1.0, "factor": 2},
                                  {"kind": "stop", "reason": ["a"]}],
                         ids=["rank-bool", "rank-arabic-digit", "rank-1e300", "rank-float", "reason-list"])
def test_command_fields_of_another_json_type_are_a_protocol_error(data: dict) -> None:
    # int() took True as rank 1, "\u0663" (an Arabic-Indic three) as rank 3 and 1e300 as a rank no worker has.
    with pytest.raises(ProtocolError, match="must be"):
        Command.from_dict(data)


@pytest.mark.parametrize("plan", [False, [], "v2"])
def test_command_with_a_plan_that_is_not_an_object_is_a_protocol_error(plan: Any) -> None:
    # {"kind": "continue", "plan": false} must not be accepted: Command.to_dict() would raise TypeError.
    with pytest.raises(ProtocolError):
        Command.from_dict({"kind": "continue", "plan": plan})


@FUZZ
@given(st.text(max_size=60) | JSON.map(json.dumps))
def test_control_script_parses_or_raises_protocol_error(text: str) -> None:
    try:
        ScriptedChannel.from_json(text)
    except ModelParallelError as error:
        assert isinstance(error, ProtocolError), f"{type(error).__name__}: {error}"
        assert "control script" in str(error) or "command" in str(error), f"the message must say what it read: {error}"


@pytest.mark.parametrize("text", ['{"1": {"kind": "stop", "rank": ' + "7" * 5000 + "}}", "[" * 100_000, '{"1": {"kind": "stop", "factor": NaN}}'],
                         ids=["huge-int", "deep", "nan"])
def test_hostile_control_script_is_a_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError, match="control script"):
        ScriptedChannel.from_json(text)
