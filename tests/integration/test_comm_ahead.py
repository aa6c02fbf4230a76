"""Receives posted ahead on one tag (the executor posts two): a changed header never lands in the next one's buffer."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import free_port, launch

# Rank 1 keeps three receives of one (peer, tag) posted before it waits for the first, as the executor's
# `_Receives` does, while rank 0's messages change shape on some streams from one round to the next
# (so a new header and repacked tensors follow the first transfer) and not on others. Every value
# must arrive exact, on the stream it was sent for; without the side tag the header of one message
# would be matched with the receive posted for the next (a gloo size error, or garbage of equal size).
_WORKER = r'''
import sys
from collections import deque
from datetime import timedelta
import torch
import torch.distributed as dist
from model_parallel.runtime.wire import comm

torch.set_num_threads(1)
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
cache = comm.HeaderCache()
STREAMS = 4

def value(round_, stream):
    rows = 2 + (round_ % 3 if stream % 2 == 0 else 0)  # even streams change shape every round
    return torch.arange(rows * 5, dtype=torch.float32).reshape(rows, 5) + 100 * round_ + stream

messages = [(r, s) for r in range(4) for s in range(STREAMS)]
if rank == 0:
    handles = [comm.send_values([value(r, s), f"r{r}s{s}"], 1, comm.TAG_ACTIVATION, cache=cache, stream=s)
               for r, s in messages]
    for handle in handles:
        handle.wait(30)
else:
    pending = deque()
    for i, (r, s) in enumerate(messages):
        while len(pending) < 3 and len(pending) + i < len(messages):  # three ahead, in message order
            _, s_next = messages[i + len(pending)]
            pending.append(comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=cache, stream=s_next))
        got = pending.popleft().wait(30)
        assert torch.equal(got[0], value(r, s)) and got[1] == f"r{r}s{s}", (r, s, got)
    print("all exact", flush=True)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow  # a two-process gloo world
def test_receives_posted_ahead_survive_header_changes(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    result = launch([[sys.executable, str(script), str(rank), str(port)] for rank in range(2)], timeout=60)
    assert result.ok, result.summary()
