"""`--redundancy 1` copies travel through torch's TCPStore in pieces: its libuv server resets a client that sends a
value over 8 MiB (found by bench/recovery.py: a resnet18 stage's copy cut rank 0 off its own store), and a copy's
pieces are deleted only once the buddy acknowledged a newer one. A real TCPStore, in this process (no process)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from model_parallel.cli.redundancy import CHUNK_BYTES, Redundancy
from model_parallel.runtime.checkpoint.live import StageState, encode


def _state(step: int, numel: int) -> StageState:
    weight = torch.arange(numel, dtype=torch.float32) + step
    return StageState(step, 0, (0,), 0, ((0,),), {"fc.weight": weight}, {}, {}, {"extra": {"next_step": step + 1}})


def _wait(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.slow  # 36 MiB through a TCPStore: several seconds
def test_a_copy_over_8_mib_arrives_whole_and_old_pieces_go_after_the_ack() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=20))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=20))
    redundancy = Redundancy(1, 0)
    # One rank that is its own buddy and source: what it sends is what it receives.
    redundancy._store, redundancy._prefix, redundancy.buddy, redundancy.source = client, "mp/redundancy/0/", 0, 0
    stop = threading.Event()
    receiver = threading.Thread(target=redundancy._receive, args=(stop,), daemon=True)
    receiver.start()
    numel = 3 * (1 << 20)  # 12 MiB of float32: three pieces of 4 MiB
    try:
        for step in (1, 2, 3):
            redundancy._outbox = _state(step, numel)
            redundancy._wake.set()
            redundancy._send_one(client, "mp/redundancy/0/0/", encode)
            assert _wait(lambda: redundancy.copy is not None and redundancy.copy[1].step == step), step
            got = redundancy.copy[1].params["fc.weight"]
            assert got.numel() == numel and torch.equal(got, torch.arange(numel, dtype=torch.float32) + step)
        assert len(encode(_state(1, numel))) > 2 * CHUNK_BYTES
        # Step 1's pieces went once step 2 was acknowledged; step 3's are the newest, step 2's stay until 3 is acked.
        assert not client.check(["mp/redundancy/0/0/data/1/0"])
        assert client.check(["mp/redundancy/0/0/data/3/0"]) and client.check(["mp/redundancy/0/0/data/3/2"])
    finally:
        stop.set()
        receiver.join(5)
