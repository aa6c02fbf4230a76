"""Joining a world is bounded by --timeout on every rank (docs/reliability.md, "Failures while training")."""
from __future__ import annotations

import re
import time

import pytest

from model_parallel.errors import PeerError
from model_parallel.runtime.launch import free_port
from model_parallel.runtime.run import Rendezvous, join_world, missing_ranks


def test_a_rank_waits_for_the_store_host_at_most_its_timeout() -> None:
    """c10d's own client retries after its timeout (2-4 x in all); the rank waits for the port itself instead."""
    port = free_port()  # nothing listens: rank 0 never started, or exited before hosting the store
    started = time.monotonic()
    with pytest.raises(PeerError) as raised:
        join_world(Rendezvous(rank=1, world_size=2, addr="127.0.0.1", port=port, backend="gloo", timeout=2))
    assert time.monotonic() - started < 30  # did not hang
    assert re.search(rf"rank 1: cannot reach the rendezvous store at 127\.0\.0\.1:{port} within 2 s \(is rank 0 running.*"
                     r"nothing accepted a connection there within 2 s \(Connection refused\)", str(raised.value)), raised.value


class GoneStore:
    """A store whose host left: every call fails as c10d's does."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    def set(self, key: str, value: str) -> None:
        raise RuntimeError("Failed to recv, got 0 bytes.")


def test_missing_ranks_of_a_store_whose_host_left_is_unknown_without_a_traceback(capfd) -> None:
    assert missing_ranks(GoneStore(), 3, deadline_s=5.0, rank=1) is None
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
