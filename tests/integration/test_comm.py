"""Point-to-point messages with a header cache: unchanged headers skipped, changed shapes still exact."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.wire import comm


def test_signature_tells_apart_what_the_header_tells_apart() -> None:
    """The sender's cached header is reused when the signature matches: equal signatures must mean equal
    headers, including values Python calls equal (1, True, 1.0) and structures holding them."""
    x = torch.zeros(2, 3)
    sig = lambda values, structure=None, wire=None: comm._signature(values, structure, wire)  # noqa: E731
    assert sig([x, 1]) == sig([torch.ones(2, 3), 1])  # values of tensors are not in the header
    different = [sig([x, 1]), sig([x, True]), sig([x, 1.0]), sig([x.requires_grad_(), 1]),
                 sig([torch.zeros(3, 2), 1]), sig([torch.zeros(2, 3, dtype=torch.float64), 1]),
                 sig([torch.zeros(2, 3), 1], {"value": 1}), sig([torch.zeros(2, 3), 1], {"value": True}),
                 sig([torch.zeros(2, 3), 1], wire=torch.bfloat16)]
    assert len(set(different)) == len(different), different


# Every worker script's start: rank argv[1] of a two-process gloo world on port argv[2].
_HEAD = r'''
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from model_parallel.runtime.wire import comm

torch.set_num_threads(1)
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
'''

# Each message: (tensor shapes, a JSON value). Changes of shape (a last partial batch), of a JSON
# value, of the number of values and a header longer than the fixed slot must all arrive exactly.
_WORKER = _HEAD + r'''
# 1, True and 1.0 are equal in Python but not on the wire: each must arrive as itself.
PLAN = [([(4, 3)], 1), ([(4, 3)], 1), ([(4, 3)], True), ([(4, 3)], 1.0), ([(4, 3)], 1), ([(2, 3)], 1),
        ([(4, 3)], 2), ([(4, 3), (5,)], 2), ([(4, 3), (5,)], 2), ([(1,)] * 40, 3), ([(1,)] * 40, 3),
        ([(4, 3)], 1), ([(4, 3)], 1)]

def message(i):
    shapes, extra = PLAN[i]
    g = torch.Generator().manual_seed(i)
    tensors = [torch.randn(s, generator=g, requires_grad=(n == 0)) for n, s in enumerate(shapes)]
    return tensors + [torch.arange(shapes[0][0]) + i, extra, torch.Size([i])]

cache = comm.HeaderCache()
# Streams (the engine's microbatch index): uneven microbatches keep one cached header each.
for tag, streams in ((comm.TAG_ACTIVATION, 1), (comm.TAG_GRADIENT, 3)):
    if rank == 0:
        handles = [comm.send_values(message(i), 1, tag, cache=cache, stream=i % streams) for i in range(len(PLAN))]
        for h in handles:
            h.wait(30)
    else:
        pending = comm.PendingRecv(0, tag, cache=cache, stream=0)
        for i in range(len(PLAN)):
            got = pending.wait(30)
            if i + 1 < len(PLAN):
                pending = comm.PendingRecv(0, tag, cache=cache, stream=(i + 1) % streams)
            want = message(i)
            assert len(got) == len(want), (i, len(got), len(want))
            for a, b in zip(got, want):
                if isinstance(b, torch.Tensor):
                    assert a.dtype == b.dtype and torch.equal(a.detach(), b.detach()), (i, a, b)
                    assert a.requires_grad == b.requires_grad, i
                else:
                    assert a == b and type(a) is type(b), (i, a, b)
        print("received all", tag, len(cache.received), flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def _run_pair(tmp_path: Path, source: str) -> None:
    """`source` as a script on ranks 0 and 1 (argv: rank, port); both must exit 0 within a minute."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    port = free_port()
    result = launch([[sys.executable, str(script), str(rank), str(port)] for rank in range(2)], timeout=60)
    assert result.ok, result.summary()


@pytest.mark.slow  # a two-process gloo world
def test_cached_headers_survive_shape_and_value_changes(tmp_path: Path) -> None:
    _run_pair(tmp_path, _WORKER)


# bf16 training: float32 values travel as bf16 (half the bytes) and arrive rounded, widened back to
# float32 with their requires_grad; integer tensors and bf16 ones (no wider than the wire) travel
# exactly. Both paths: with the header cache (the engine's) and without.
_WIRE_WORKER = _HEAD + r'''
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 256, generator=g).requires_grad_()  # float32: 65536 bytes, 32768 as bf16
exempt = torch.randn(8, generator=g).to(torch.bfloat16)   # already bf16: exact, 16 bytes
values = [x, torch.arange(5), exempt]
nbytes = {}
for cache in (None, comm.HeaderCache()):
    for wire in (None, None, torch.bfloat16, torch.bfloat16, None):  # header changes both ways
        if rank == 0:
            handle = comm.send_values(values, 1, comm.TAG_ACTIVATION, cache=cache, stream=0, wire_dtype=wire)
            handle.wait(30)
            nbytes.setdefault((cache is not None, wire), []).append(handle.nbytes)
        else:
            got = comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=cache, stream=0).wait(30)
            want = x.detach().to(torch.bfloat16).float() if wire is not None else x.detach()
            assert got[0].dtype == torch.float32 and got[0].requires_grad and got[0].is_leaf, got[0]
            assert torch.equal(got[0].detach(), want), (wire, cache)
            assert not torch.equal(want, x.detach()) or wire is None  # the rounding is visible
            assert torch.equal(got[1], torch.arange(5)) and torch.equal(got[2], exempt), (wire, cache)
if rank == 0:
    # steady state with the cache: one packed transfer, 16-byte prefix + each tensor 16-byte aligned
    full, half = min(nbytes[(True, None)]), min(nbytes[(True, torch.bfloat16)])
    assert full == 16 + 65536 + 48 + 16 and half == 16 + 32768 + 48 + 16, (full, half)
    uncached_full, uncached_half = min(nbytes[(False, None)]), min(nbytes[(False, torch.bfloat16)])
    assert uncached_full - uncached_half == 32768, (uncached_full, uncached_half)
    print("bytes", full, half, uncached_full, uncached_half, flush=True)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow  # a two-process gloo world
def test_bf16_wire_halves_the_bytes_and_arrives_rounded_in_float32(tmp_path: Path) -> None:
    _run_pair(tmp_path, _WIRE_WORKER)


# A value's layout crosses the boundary with it: a channels_last activation (a convnet converted with
# `model.to(memory_format=torch.channels_last)`) arrived row-major, so the next stage's convolutions ran other kernels
# and rounded otherwise (resnet18: 1.2e-7 after one step, 0.25 after four; tests/integration/test_channels_last.py).
# Every dense layout arrives with the sender's strides, on both paths, a change of layout under one cached header
# included; a slice (not dense) arrives row-major with its values.
_LAYOUT_WORKER = _HEAD + r'''
g = torch.Generator().manual_seed(0)
CL, CL3 = torch.channels_last, torch.channels_last_3d
VALUES = [
    lambda: torch.randn(4, 8, 5, 5, generator=g).contiguous(memory_format=CL).requires_grad_(),
    lambda: torch.randn(4, 8, 5, 5, generator=g),                                  # the same shape, row-major again
    lambda: torch.randn(4, 8, 1, 1, generator=g).contiguous(memory_format=CL),     # strides (8, 1, 8, 8): row-major
    lambda: torch.randn(2, 3, 4, 4, 4, generator=g).contiguous(memory_format=CL3),
    lambda: torch.randn(6, 7, generator=g).t(),                                    # a transpose
    lambda: torch.randn(3, 4, 5, generator=g).permute(2, 0, 1),
    lambda: torch.randn(8, 8, generator=g)[:, ::2],                                # not dense: arrives row-major
]
for cache in (None, comm.HeaderCache()):
    for wire in (None, torch.bfloat16):
        for i, make in enumerate(VALUES):
            value = make()
            if rank == 0:
                comm.send_values([value, 7], 1, comm.TAG_ACTIVATION, cache=cache, stream=0, wire_dtype=wire).wait(30)
                continue
            got = comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=cache, stream=0).wait(30)
            want = value.detach().to(wire).float() if wire is not None else value.detach()
            assert torch.equal(got[0].detach(), want) and got[1] == 7, (i, wire, cache)
            dense = i != len(VALUES) - 1
            assert got[0].stride() == (value.stride() if dense else want.contiguous().stride()), \
                (i, wire, cache is not None, got[0].stride(), value.stride())
            assert got[0].requires_grad == value.requires_grad, i
print("layouts ok", rank, flush=True)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow  # a two-process gloo world
def test_every_dense_layout_arrives_with_the_senders_strides(tmp_path: Path) -> None:
    _run_pair(tmp_path, _LAYOUT_WORKER)
