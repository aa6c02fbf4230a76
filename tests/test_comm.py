"""Point-to-point messages with a header cache: unchanged headers skipped, changed shapes still exact."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import free_port, launch

pytestmark = pytest.mark.slow  # a two-process gloo world

# Each message: (tensor shapes, a JSON value). Changes of shape (a last partial batch), of a JSON
# value, of the number of values and a header longer than the fixed slot must all arrive exactly.
_WORKER = r'''
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from model_parallel.runtime import comm

torch.set_num_threads(1)
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
PLAN = [([(4, 3)], 1), ([(4, 3)], 1), ([(4, 3)], 1), ([(2, 3)], 1), ([(4, 3)], 2), ([(4, 3), (5,)], 2),
        ([(4, 3), (5,)], 2), ([(1,)] * 40, 3), ([(1,)] * 40, 3), ([(4, 3)], 1), ([(4, 3)], 1)]

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
                    assert a == b, (i, a, b)
        print("received all", tag, len(cache.received), flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def test_cached_headers_survive_shape_and_value_changes(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    result = launch([[sys.executable, str(script), str(rank), str(port)] for rank in range(2)], timeout=60)
    assert result.ok, result.summary()
