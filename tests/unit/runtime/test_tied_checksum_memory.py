"""The tied-parameter check (run at every checkpoint) holds a chunk of float64 at a time, not the parameter 4x over.

`_checksum` made a float64 copy of the whole parameter and float64 position weights of its size: for a GPT-2's tied
24 MB embedding 96 MB at once, unpriced by the memory model; a rank capped with RLIMIT_DATA that had trained under
the cap ran out of memory at its first checkpoint (runtime/build/tied.py)."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from model_parallel.runtime.build import tied
from model_parallel.runtime.build.tied import CHECKSUM_CHUNK, _checksum


def largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


def test_the_checksum_allocates_a_chunk_not_the_parameter():
    param = torch.nn.Parameter(torch.randn(4 * CHECKSUM_CHUNK + 5))  # 16 MB of fp32
    assert largest_allocation(lambda: _checksum(param)) <= 8 * CHECKSUM_CHUNK  # one chunk's float64 (was 2 x 32 MB)


def test_the_checksum_tells_values_and_positions_apart(monkeypatch):
    monkeypatch.setattr(tied, "CHECKSUM_CHUNK", 7)  # several chunks and a partial one
    values = torch.randn(50)
    swapped = values.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert torch.equal(_checksum(values), _checksum(values.clone()))
    assert _checksum(values)[0] == _checksum(swapped)[0] and _checksum(values)[1] != _checksum(swapped)[1]
    weights = torch.linspace(1.0, 2.0, 50, dtype=torch.float64)  # the weighting the whole-tensor form used
    torch.testing.assert_close(_checksum(values)[1], torch.dot(values.double(), weights), rtol=1e-12, atol=1e-12)
