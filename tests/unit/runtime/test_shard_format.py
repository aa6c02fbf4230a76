"""The safetensors shard (runtime/checkpoint/shardio.py, skeleton.py): every kind of value a shard holds reads back
bitwise and type-exact, any safetensors reader opens it, a hostile header is one CheckpointError, and a read never
unpickles anything."""
from __future__ import annotations

import hashlib
import json
import math
import pickle
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint import store as ckpt
from model_parallel.runtime.checkpoint.state import StreamedState
from model_parallel.runtime.step.offload import attach, step_optimizer

EXTRA = {"tuple": (1, 2.5, "x", None, True), 7: [[1, [2, (3,)]], {}], (1, "k"): -0.0, 2.5: False,
         "floats": [math.inf, -math.inf, math.nan, -math.nan, 1e308, 5e-324], "bool_int": [True, 1, False, 0],
         "ordered": OrderedDict([("z", 1), ("a", 2)]), "big": 2**63 + 1, "rng": torch.get_rng_state(),
         "": {"": "empty keys", "a/b~c": torch.arange(3)}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _trained(optimizer_class, offload_dir=None, **kwargs):
    model = _model()
    optimizer = optimizer_class(model.parameters(), lr=0.1, **kwargs)
    if offload_dir is not None:
        attach(optimizer, offload_dir, 24)  # a few bytes a slice: every state cut in pieces
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        step_optimizer(optimizer)
        optimizer.zero_grad()
    return model, optimizer


def _same(a, b) -> bool:
    """Equal bitwise (nan too) and of the same types all the way down."""
    if isinstance(a, torch.Tensor):
        raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        return type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):  # in order where a dict has one (the checkpoint API lists names sorted)
        keys = (list if type(a) is OrderedDict else set)
        return keys(a) == keys(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _payload():
    torch.manual_seed(1)
    params = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
              "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    buffers = {"count": torch.tensor([2**62, -1], dtype=torch.int64), "mask": torch.tensor([True, False, True]),
               "u8": torch.arange(4, dtype=torch.uint8)}
    return params, buffers


def test_every_kind_of_value_reads_back_bitwise_and_type_exact(tmp_path: Path) -> None:
    params, buffers = _payload()
    adamw, sgd = _trained(torch.optim.AdamW)[1], _trained(torch.optim.SGD, momentum=0.9)[1]
    named = dict(_model().named_parameters())
    state = {f"adamw.{name}": entry for name, entry in ckpt.optimizer_state_by_name(adamw, dict(zip(named, [
        p for g in adamw.param_groups for p in g["params"]]))).items()}
    state.update({f"sgd.{name}": entry for name, entry in ckpt.optimizer_state_by_name(sgd, dict(zip(named, [
        p for g in sgd.param_groups for p in g["params"]]))).items()})
    state["f32"] = {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4), "betas_seen": (0.9, 0.999), "n": 4}
    params.update({name: torch.zeros(1) for name in state if name != "f32"})
    ckpt.save_shard(tmp_path, 5, 0, params, buffers, state, EXTRA)
    ckpt.finalize(tmp_path, 5, {}, None)
    checkpoint = ckpt.load_checkpoint(tmp_path)
    assert _same(checkpoint.params(), params) and _same(checkpoint.buffers(), buffers)
    assert _same(checkpoint.shard_extra(0), EXTRA) and list(checkpoint.shard_extra(0)) == list(EXTRA)
    assert _same(dict(checkpoint.optimizer_state()), state)
    assert isinstance(state["adamw.0.weight"]["step"], torch.Tensor) and "momentum_buffer" in state["sgd.0.weight"]


def test_an_offloaded_optimizers_state_goes_file_to_file_and_back(tmp_path: Path) -> None:
    model, optimizer = _trained(torch.optim.AdamW, tmp_path / "offload")
    reference_model, reference = _trained(torch.optim.AdamW)
    named = dict(model.named_parameters())
    streamed = ckpt.optimizer_state_by_name(optimizer, named)
    assert isinstance(streamed, StreamedState) and streamed.ranges is not None
    ckpt.save_shard(tmp_path / "ckpt", 1, 0, {k: v.detach() for k, v in named.items()}, None, streamed)
    ckpt.finalize(tmp_path / "ckpt", 1, {}, None)
    loaded = ckpt.load_checkpoint(tmp_path / "ckpt").optimizer_state()
    expected = ckpt.optimizer_state_by_name(reference, dict(reference_model.named_parameters()))
    assert _same(dict(loaded), expected)
    # Into a fresh offloaded optimizer: each tensor a FileRange over the shard, copied into its files.
    model_b = _model()
    optimizer_b = torch.optim.AdamW(model_b.parameters(), lr=0.1)
    attach(optimizer_b, tmp_path / "offload_b", 24)
    ranges = loaded.ranges(next(iter(loaded)))
    assert any(type(v).__name__ == "FileRange" for v in ranges.values())
    ckpt.load_optimizer_state_by_name(optimizer_b, dict(model_b.named_parameters()), loaded)
    assert _same(dict(ckpt.optimizer_state_by_name(optimizer_b, dict(model_b.named_parameters()))), expected)


def test_any_safetensors_reader_opens_a_shard(tmp_path: Path) -> None:
    params, buffers = _payload()
    path = ckpt.save_shard(tmp_path, 1, 0, params, buffers, None, EXTRA)
    assert path.name == "shard_0.safetensors"
    with safe_open(path, "pt") as f:
        for name, tensor in {**{f"params/{k}": v for k, v in params.items()},
                             **{f"buffers/{k}": v for k, v in buffers.items()}}.items():
            assert _same(f.get_tensor(name), tensor)
        assert _same(f.get_tensor("extra//a~1b~0c"), EXTRA[""]["a/b~c"])  # '/' and '~' escaped in names
        assert json.loads(f.metadata()["skeleton"])["dict"][0][0] == "params"


@pytest.mark.parametrize("value, what", [
    ({1, 2}, "a builtins.set"), (torch.Size([2]), "a torch.Size"), (torch.float32, "a torch.dtype"),
    ({frozenset(): 1}, "keyed by a frozenset"), ({(1, torch.ones(1)): 2}, "a tensor inside a dict key"), (10**70, "an integer of more than 64 digits"),
])
def test_a_value_the_shard_cannot_hold_exactly_is_refused_naming_it(tmp_path: Path, value, what: str) -> None:
    with pytest.raises(CheckpointError, match=rf"shard_0\.safetensors: extra/bad(/.*)? is {what}"):
        ckpt.save_shard(tmp_path, 1, 0, {"w": torch.ones(1)}, extra={"bad": value})
    assert not list(tmp_path.rglob("*.safetensors"))


def test_a_dtype_safetensors_lacks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"params/w is torch.complex128, which safetensors has no name for"):
        ckpt.save_shard(tmp_path, 1, 0, {"w": torch.ones(2, dtype=torch.complex128)})


def _committed(root: Path) -> Path:
    params, buffers = _payload()
    ckpt.save_shard(root, 2, 0, params, buffers, {"f32": {"exp_avg": torch.ones(3, 4)}}, {"t": (1, torch.ones(2))})
    ckpt.finalize(root, 2, {}, None)
    return root / "step_2" / "shard_0.safetensors"


def _rewrite(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    """The shard replaced by `header` and `data`, with a manifest that matches (only the content is hostile)."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text) if length is None else length) + text + data
    path.write_bytes(blob)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (path.parent / "manifest.json").write_text(json.dumps(manifest))


def _parts(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    length = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def _skeleton(header: dict, change) -> None:
    skeleton = json.loads(header["__metadata__"]["skeleton"])
    change(skeleton)
    header["__metadata__"]["skeleton"] = json.dumps(skeleton)


HOSTILE = {
    "huge header length": (lambda h, d: (h, d, 2**40), r"a header of 1099511627776 bytes"),
    "offsets outside the file": (lambda h, d: (h["params/f32"].update(data_offsets=[0, 10**9]), d, None),
                                 r"data_offsets \[0, 1000000000\], outside the file's data"),
    "overlapping offsets": (lambda h, d: (h["params/f16"].update(data_offsets=list(h["params/f32"]["data_offsets"][:1])
                                                                 + [h["params/f32"]["data_offsets"][0] + 8]), d, None),
                            r"overlap or leave a gap"),
    "unknown dtype": (lambda h, d: (h["params/f32"].update(dtype="PICKLE"), d, None), r"unknown dtype 'PICKLE'"),
    "negative shape": (lambda h, d: (h["params/f32"].update(shape=[-3, -4]), d, None), r"not a list of sizes >= 0"),
    "shape against bytes": (lambda h, d: (h["params/f32"].update(shape=[4, 4]), d, None), r"holds 48 bytes"),
    "NaN literal": (lambda h, d: (h["params/f32"].update(shape=[float("nan")]), d, None), r"NaN is not a number"),
    "missing tensor": (lambda h, d: (h["__metadata__"].update(skeleton=h["__metadata__"]["skeleton"].replace(
        '"params/f32"', '"params/nope"')), d, None), r"names the tensor 'params/nope' the header does not hold"),
    "unnamed tensor": (lambda h, d: (h.update({"stray": {"dtype": "U8", "shape": [2], "data_offsets": [len(d), len(d) + 2]}}),
                                     d + b"xx", None), r"tensors the skeleton does not name: \['stray'\]"),
    "no metadata": (lambda h, d: (h.pop("__metadata__"), d, None), r"no model_parallel.shard/2 metadata"),
    "skeleton of another tag": (lambda h, d: (_skeleton(h, lambda s: s["dict"][0].__setitem__(1, {"pickle": "x"})), d, None),
                                r"skeleton: .* is not a value this format writes"),
    "repeated key": (lambda h, d: (_skeleton(h, lambda s: s["dict"].append(s["dict"][0])), d, None), r"key 'params' is repeated"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_one_checkpoint_error(tmp_path: Path, case: str) -> None:
    path = _committed(tmp_path)
    header, data = _parts(path)
    change, message = HOSTILE[case]
    result = change(header, data)
    _rewrite(path, header, result[1], result[2])
    with pytest.raises(CheckpointError, match=message) as caught:
        checkpoint = ckpt.load_checkpoint(tmp_path)
        checkpoint.params()
        dict(checkpoint.optimizer_state())
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)


def test_reading_a_checkpoint_unpickles_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _committed(tmp_path)
    params, buffers = _payload()

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint read unpickled")
    for owner, name in ((pickle, "Unpickler"), (pickle, "load"), (pickle, "loads"), (torch, "load"),
                        (torch.serialization, "load"), (torch._weights_only_unpickler, "Unpickler"),
                        (torch._weights_only_unpickler, "load")):
        monkeypatch.setattr(owner, name, refuse)
    checkpoint = ckpt.load_checkpoint(tmp_path)
    assert _same(checkpoint.params(), params) and _same(checkpoint.buffers(), buffers)
    assert _same(dict(checkpoint.optimizer_state()), {"f32": {"exp_avg": torch.ones(3, 4)}})
    assert _same(checkpoint.shard_extra(0), {"t": (1, torch.ones(2))})
