"""Rank 0's JoinWatch on the per-step command path (the command polled in step k rides in step k's reduction and is
applied after k) and the joiner's guarded store calls, without processes."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from model_parallel.cli.worker_join import JOIN_AT_STEP_ENV, JoinWatch, store_guard
from model_parallel.errors import PeerError
from model_parallel.messages import Command, NullChannel
from model_parallel.runtime.wire import join as wire
from model_parallel.runtime.wire import step_totals
from support.stores import DictStore


def watch(store: DictStore, members: int = 2) -> JoinWatch:
    lineage = SimpleNamespace(base_store=store, members=tuple(range(members)),
                              addresses=tuple("127.0.0.1" for _ in range(members)), generation=0, base_port=29500,
                              store_host=0, store_port=29500)
    return JoinWatch(NullChannel(), SimpleNamespace(lineage=lineage, options=SimpleNamespace(timeout=0.01)))


def test_the_admission_lands_after_the_step_the_test_hook_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """MP_TEST_JOIN_AT_STEP=4: the poll of step 3 (before_step=4) admits nobody; the poll of step 4 (before_step=5,
    before step 4's report) takes the request: every rank applies it after step 4, as before the command moved into
    the reduction."""
    monkeypatch.setenv(JOIN_AT_STEP_ENV, "4")
    store = DictStore()
    channel = watch(store)
    nonce = wire.post_request(store, "10.0.0.9", deadline=float("inf"))
    channel.report(SimpleNamespace(step=2))
    assert channel.poll(before_step=4) is None
    assert store.get(wire.REQUEST).decode() != wire.TAKEN  # still pending: nobody took it early
    channel.report(SimpleNamespace(step=3))
    command = channel.poll(before_step=5)
    assert command is not None and command.kind == "stop"
    admission = wire.Admission.from_json(str(command.extra["join"]))
    assert (admission.nonce, admission.address, admission.original, admission.generation) == (nonce, "10.0.0.9", 2, 1)
    assert wire.wait_admission(store, nonce, deadline=float("inf")) == admission


def test_the_admission_stop_rides_in_the_step_reduction_whole() -> None:
    """The stop with its admission JSON (even for a world of 1000 addresses) is announced by its byte length in the
    reduction and arrives unchanged."""
    store = DictStore()
    channel = watch(store, members=1000)
    wire.post_request(store, "10.0.0.9", deadline=float("inf"))
    command = channel.poll(before_step=1)
    assert command is not None
    totals, payload = step_totals.pack(1.5, 0.0, command)
    sums = step_totals.unpack(totals)
    assert sums.command_bytes == len(payload) > 20_000
    received = Command.from_json(payload.decode())
    assert received == command
    assert wire.Admission.from_json(str(received.extra["join"])).original == 1000


class ClosedStore(DictStore):
    """A store whose host died: every call fails the way TCPStore's client does."""

    def _closed(self, *_: Any) -> Any:
        raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    check = get = compare_set = wait = _closed  # type: ignore[assignment]


@pytest.mark.parametrize("call", [
    lambda s: wire.read_flags(s, 0.01),
    lambda s: wire.post_request(s, "10.0.0.9", deadline=float("inf")),
    lambda s: wire.wait_admission(s, "abc", deadline=float("inf")),
])
def test_a_store_that_closes_the_connection_is_a_peer_error_naming_it(call: Any) -> None:
    with pytest.raises(PeerError, match=r"^--join 127.0.0.1:29500: the job's store failed while waiting .*Failed to "
                                        r"recv") as raised:
        with store_guard("127.0.0.1:29500", "waiting"):
            call(ClosedStore())
    assert "\n" not in str(raised.value)


def test_a_flags_wait_that_times_out_is_no_job_there() -> None:
    class Silent(DictStore):
        def wait(self, keys: list[str], timeout: Any) -> None:
            raise dist.DistStoreError("wait timeout after 10ms, keys: /mp/job/flags")

    assert wire.read_flags(Silent(), 0.01) is None
