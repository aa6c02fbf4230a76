"""FileRange (runtime/step/file_range.py): a tensor's bytes in files, sliced by elements and copied file to file;
an offloaded optimizer's state moved between offloads cut in different pieces, and resumed from a shard, unread."""
from __future__ import annotations

import io
import sys

import pytest
import torch

from model_parallel.runtime.checkpoint import store as ckpt
from model_parallel.runtime.step import offload as off
from model_parallel.runtime.step.file_range import FileRange


def test_elements_cut_across_segments_and_copy_the_bytes(tmp_path):
    data = torch.arange(10, dtype=torch.float32)
    (tmp_path / "a").write_bytes(b"xx" + data[:3].numpy().tobytes())  # 2 bytes before the first segment
    (tmp_path / "b").write_bytes(data[3:].numpy().tobytes())
    whole = FileRange((10,), torch.float32, ((tmp_path / "a", 2, 12), (tmp_path / "b", 0, 28)))
    part = whole.elements(2, 7)
    assert part.shape == (5,) and part.nbytes == 20 and len(part.segments) == 2
    out = io.BytesIO()
    assert part.copy_into(out) == 20
    assert torch.equal(torch.frombuffer(bytearray(out.getvalue()), dtype=torch.float32), data[2:7])
    with pytest.raises(OSError, match="ended 28 bytes before"):
        FileRange((10,), torch.float32, ((tmp_path / "a", 2, 12), (tmp_path / "b", 40, 28))).copy_into(io.BytesIO())


def _trained(tmp_path, chunk):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    off.attach(optimizer, tmp_path / f"off{chunk}", chunk)
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        off.step_optimizer(optimizer)
    return model, optimizer


@pytest.mark.parametrize("source_chunk, target_chunk", [(300, 1000), (1 << 20, 200)])
def test_state_moves_file_to_file_between_offloads_cut_differently_and_from_a_shard(tmp_path, source_chunk, target_chunk):
    model, optimizer = _trained(tmp_path, source_chunk)
    named = dict(model.named_parameters())
    expected = {id(p): s for p, s in off.optimizer_state_items(optimizer)}
    streamed = ckpt.optimizer_state_by_name(optimizer, named)
    ckpt.save_shard(tmp_path / "ck", 2, 0, named, {}, streamed)
    ckpt.finalize(tmp_path / "ck", 2, {}, None)
    sources = {"switch": streamed, "shard": ckpt.load_checkpoint(tmp_path / "ck").optimizer_state(list(named))}
    for what, state in sources.items():
        again = torch.optim.AdamW(model.parameters(), lr=0.01)
        off.attach(again, tmp_path / f"{what}{target_chunk}", target_chunk)
        ckpt.load_optimizer_state_by_name(again, named, state, copy=False)
        got = dict(off.optimizer_state_items(again))
        assert len(got) == len(expected)
        for param, entry in got.items():
            for key, value in entry.items():
                assert torch.equal(value, expected[id(param)][key]), (what, key)


def test_mapped_empty_maps_large_tensors_privately_and_leaves_small_ones_to_the_heap():
    from model_parallel.allocator import MAPPED_MIN, mapped_empty

    big = mapped_empty((MAPPED_MIN // 4 + 3,), torch.float32)
    big.fill_(2.0)
    assert big.shape == (MAPPED_MIN // 4 + 3,) and float(big.sum()) == 2.0 * big.numel()
    maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
    if maps:  # its own private anonymous mapping, counted by RLIMIT_DATA ("p", not "s")
        start = big.data_ptr()
        line = next(line for line in maps.splitlines()
                    if int(line.split()[0].split("-")[0], 16) <= start < int(line.split()[0].split("-")[1], 16))
        assert line.split()[1].endswith("p")
    small = mapped_empty((3, 4), torch.bfloat16)
    assert small.shape == (3, 4) and small.dtype == torch.bfloat16
