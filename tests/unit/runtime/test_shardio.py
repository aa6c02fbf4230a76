"""Shards written and read a tensor at a time (runtime/checkpoint/shardio.py): safetensors that safe_open reads,
a StreamedState read one entry at a time on both sides, shards of earlier versions (torch pickles) refused."""
from __future__ import annotations

import hashlib
import json
import weakref

import pytest
import torch
from safetensors import safe_open

from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint import store as ckpt
from model_parallel.runtime.checkpoint.state import StreamedState


def _values():
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    params = {"a.weight": base[1:4], "b.bias": torch.randn(7).to(torch.bfloat16), "c.scale": torch.tensor(2.5),
              "d.empty": torch.zeros(0, 3)}
    optimizer = {"a.weight": {"exp_avg": torch.randn(3, 5), "exp_avg_sq": torch.rand(3, 5), "step": torch.tensor(4.0)},
                 "b.bias": {"momentum_buffer": torch.randn(7).to(torch.bfloat16), "lr_seen": 0.1}}
    extra = {"rng": torch.get_rng_state(), "nested": [1, (2, torch.arange(4)), {"x": "y"}]}
    return params, {"buf": torch.ones(2, 2)}, optimizer, extra


def _streamed(optimizer, reads, alive):
    """`optimizer` as a StreamedState that records each read and checks the previous entry is gone first."""
    def read(name):
        assert all(ref() is None for ref in alive), "an earlier entry is still alive when the next is read"
        reads.append(name)
        entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer[name].items()}
        alive[:] = [weakref.ref(v) for v in entry.values() if isinstance(v, torch.Tensor)]
        return entry
    layout = {name: {k: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
                     for k, v in entry.items()} for name, entry in optimizer.items()}
    return StreamedState(layout, read)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_a_streamed_shard_is_safetensors_and_its_state_is_read_one_parameter_at_a_time(tmp_path):
    params, buffers, optimizer, extra = _values()
    reads: list[str] = []
    alive: list = []
    path = ckpt.save_shard(tmp_path, 3, 0, params, buffers, _streamed(optimizer, reads, alive), extra)
    assert reads == list(optimizer)  # each entry read once, in order, none alive beside the next (asserted in read)
    with safe_open(path, "pt") as f:  # any safetensors reader sees every tensor by its path in the payload
        assert f.metadata()["format"] == "model_parallel.shard/2"
        assert _equal(f.get_tensor("params/a.weight"), params["a.weight"])
        assert _equal(f.get_tensor("optimizer/b.bias/momentum_buffer"), optimizer["b.bias"]["momentum_buffer"])
        assert _equal(f.get_tensor("extra/nested/1/1"), extra["nested"][1][1])
        assert len(f.keys()) == 4 + 1 + 4 + 2
    index = json.loads(path.with_suffix(".json").read_text())
    data = path.read_bytes()
    assert index["bytes"] == len(data) and index["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_resume_reads_the_state_a_parameter_at_a_time_and_values_as_saved(tmp_path, monkeypatch):
    params, buffers, optimizer, extra = _values()
    ckpt.save_shard(tmp_path, 3, 0, params, buffers, optimizer, extra)
    ckpt.finalize(tmp_path, 3, {}, None)
    checkpoint = ckpt.load_checkpoint(tmp_path)
    state = checkpoint.optimizer_state()
    assert isinstance(state, StreamedState) and sorted(state) == sorted(optimizer)
    assert state.layout["a.weight"]["exp_avg"].device.type == "meta"  # nothing read yet
    for name in optimizer:
        assert _equal(state[name], optimizer[name])
    assert _equal(checkpoint.params(), params) and _equal(checkpoint.buffers(), buffers)
    assert _equal(checkpoint.shard_extra(0), extra)
    assert _equal(dict(state.renamed({"renamed": "b.bias"})), {"renamed": optimizer["b.bias"]})


def test_a_shard_written_by_torch_save_is_refused_not_unpickled(tmp_path, monkeypatch):
    """An earlier version's shard (one torch.save payload, shard_<rank>.pt) is never loaded implicitly."""
    params, buffers, optimizer, extra = _values()
    path = ckpt.save_shard(tmp_path, 1, 0, params, buffers, optimizer, extra)
    old = _as_pickled_shard(path, {"params": params, "buffers": buffers, "optimizer": optimizer, "extra": extra})
    ckpt.finalize(tmp_path, 1, {}, None)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(CheckpointError, match=r"written by an earlier model_parallel as torch pickles, which this "
                                              r"version does not read .* model-parallel checkpoint-upgrade "):
        ckpt.load_checkpoint(tmp_path)
    assert old.is_file()


def _as_pickled_shard(path, payload):
    """The shard at `path` replaced by what earlier versions wrote: torch.save of the payload as shard_<rank>.pt."""
    old = path.with_suffix(".pt")
    torch.save(payload, old)
    path.unlink()
    index = json.loads(path.with_suffix(".json").read_text())
    data = old.read_bytes()
    index.update(file=old.name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.with_suffix(".json").write_text(json.dumps(index))
    return old


def test_a_tensor_record_outside_the_file_is_refused(tmp_path):
    params, buffers, optimizer, extra = _values()
    ckpt.save_shard(tmp_path, 1, 0, params, buffers, optimizer, extra)
    ckpt.finalize(tmp_path, 1, {}, None)
    checkpoint = ckpt.load_checkpoint(tmp_path)
    checkpoint._shard(0)
    checkpoint._readers[0].size = 100  # as if the skeleton named offsets past the file's end
    with pytest.raises(CheckpointError, match="lies outside the 100-byte shard"):
        checkpoint.params(["a.weight"])


def test_streamed_state_renamed_and_with_entries_read_only_what_is_asked():
    reads: list[str] = []
    state = StreamedState({"a": {"m": torch.empty(2, device="meta")}, "b": {"m": torch.empty(3, device="meta")}},
                          lambda name: reads.append(name) or {"m": torch.full((2 if name == "a" else 3,), 1.0)})
    arriving = {"c": {"m": torch.zeros(4)}}
    merged = state.renamed({"x": "a", "y": "b", "gone": "nope"}).with_entries(arriving)
    assert sorted(merged) == ["c", "x", "y"] and reads == []  # names and layouts only, nothing read
    assert merged["c"]["m"] is arriving["c"]["m"]  # arriving state taken over, not copied
    assert torch.equal(merged["y"]["m"], torch.ones(3)) and reads == ["b"]
    with pytest.raises(KeyError):
        merged["a"]


def test_state_that_changed_between_layout_and_write_is_refused(tmp_path):
    params, buffers, optimizer, extra = _values()
    layout = {"a.weight": {"exp_avg": torch.empty(3, 5, device="meta")}}
    changed = StreamedState(layout, lambda name: {"exp_avg": torch.zeros(3, 5), "exp_avg_sq": torch.zeros(3, 5)})
    with pytest.raises(CheckpointError, match="must not step during a checkpoint"):
        ckpt.save_shard(tmp_path, 1, 0, params, buffers, changed, extra)
    assert not list(tmp_path.rglob("*.safetensors"))  # the temporary file is removed, nothing renamed into place
