"""runtime/wire/recovery.py without a world: which rank a PeerError blames, and original ranks across generations."""
from __future__ import annotations

import pytest

from model_parallel.runtime.wire.recovery import Lineage, lost_ranks


@pytest.mark.parametrize("message, want", [
    ("[rank 0 stage 0] rank 1 stopped responding (last heartbeat 1.6 s ago); receive with rank 1 failed: reset", 1),
    ("[rank 2 stage 2] rank 0 stopped responding (it hosts the rendezvous store at 127.0.0.1:5, which is unreachable)", 0),
    ("[rank 1 stage 1] rank 3 failed: [rank 3 stage 3] failed while training: RuntimeError: shapes", 3),
    ("[rank 1 stage 1] rank 1 stopped responding: this process stood still for 6.8 s (SIGSTOP ...)", 1),
    # No culprit named: the detail's "with rank 1 failed" is not a verdict.
    ("[rank 0 stage 0] communication failed but every peer is still alive (slow peer? raise --timeout); "
     "receive with rank 1 failed: timed out", None),
    ("[rank 0 stage 0] rank(s) [1] already finished while rank 0 still needed them", None),
])
def test_lost_ranks_reads_the_verdict_not_the_detail(message: str, want: object) -> None:
    assert lost_ranks(message) == want


def test_current_ranks_map_to_original_ranks() -> None:
    lineage = Lineage(me=2, generation=1, members=(0, 2, 3), addresses=("h0", "h1", "h2", "h3"), base_port=29500,
                      store_host=0, store_port=29500, base_store=None, world_store=None)
    assert [lineage.original(r) for r in range(3)] == [0, 2, 3]
