"""A worker's first connection to the coordinator: a refused one (started in the background a moment before its
workers, the documented quick start) is retried for a bounded time, logged once; anything else fails at once."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel
from model_parallel.coordinator.connect import check_token
from model_parallel.coordinator.server import Coordinator
from model_parallel.coordinator.solver import default_solver
from model_parallel.errors import ProtocolError
from model_parallel.runtime.launch import free_port
from support.coordinators import chain_graph, live_coordinator, two_stage_plan

TOKEN = b"first-connection-token"
GRAPH = chain_graph(6)


class Waiting(logging.Handler):
    """Set once a record saying that the client waits for the coordinator is logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "nothing listens at the coordinator's address" in message:
            self.messages.append(message)
            self.seen.set()


@pytest.fixture
def waiting():
    handler = Waiting()
    logger = logging.getLogger("model_parallel.coordinator.connect")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_a_channel_waits_for_a_coordinator_that_starts_after_it(waiting) -> None:
    port = free_port()
    made: dict[str, object] = {}

    def connect() -> None:
        try:
            made["channel"] = CoordinatorChannel(f"127.0.0.1:{port}", TOKEN, rank=0, world_size=2, timeout=5, wait_for=120)
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            made["error"] = error

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    assert waiting.seen.wait(60), "the channel never said that it waits for the coordinator"
    # Only now does anything listen there: the channel's first attempt was refused.
    coordinator = Coordinator(GRAPH, two_stage_plan(GRAPH, 3), TOKEN, policy="manual", solver=default_solver,
                              config=pol.PolicyConfig(window=3))
    coordinator.start("127.0.0.1", port)
    try:
        thread.join(60)
        assert not thread.is_alive() and "error" not in made, made
        channel = made["channel"]
        try:
            assert channel.session is not None and sorted(coordinator.workers) == [0]
        finally:
            channel.close()
    finally:
        coordinator.stop()
    assert len(waiting.messages) == 1, waiting.messages  # said once, not per attempt
    assert f"127.0.0.1:{port}" in waiting.messages[0] and "waiting up to 120 s" in waiting.messages[0]


def test_a_wrong_token_fails_at_once_even_while_willing_to_wait(waiting) -> None:
    with live_coordinator(TOKEN, GRAPH, two_stage_plan(GRAPH, 3), policy="manual") as coordinator:
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=f"coordinator at {coordinator.address} refused rank 0.*wrong token"):
            CoordinatorChannel(coordinator.address, b"not-the-token", rank=0, world_size=2, timeout=5, wait_for=600)
        assert time.monotonic() - started < 60  # not retried for the 600 s it was willing to wait
    assert not waiting.seen.is_set()


def test_a_coordinator_that_never_listens_is_named_after_the_wait(waiting) -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ProtocolError, match=f"cannot reach the coordinator at {address}: Connection refused.*"
                                            "nothing listened there for 1 s"):
        CoordinatorChannel(address, TOKEN, rank=0, world_size=2, timeout=5, wait_for=1)
    assert waiting.seen.is_set()


def test_without_a_wait_a_refused_first_connection_fails_at_once(waiting) -> None:
    """The default (a channel built in Python, `wait_for` 0): as before, no retry and no waiting line."""
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ProtocolError, match=f"cannot reach the coordinator at {address}"):
        CoordinatorChannel(address, TOKEN, rank=0, world_size=2, timeout=5)
    assert not waiting.seen.is_set()


def test_a_probe_is_answered_for_the_coordinator_s_token_only() -> None:
    """A worker checks its token before joining the world (cli/worker.reach_coordinator): the coordinator answers a
    probe signed with its token, registers no one for it, and drops one signed with another token unanswered."""
    with live_coordinator(TOKEN, GRAPH, two_stage_plan(GRAPH, 3), policy="manual") as coordinator:
        check_token(coordinator.address, TOKEN, timeout=5, wait_for=0, rank=1)
        assert coordinator.workers == {}
        with pytest.raises(ProtocolError, match=f"the coordinator at {coordinator.address} hung up on rank 1's first "
                                                r"message without an answer.*this worker's token is not the coordinator's"):
            check_token(coordinator.address, b"not-the-token", timeout=5, wait_for=0, rank=1)
        channel = CoordinatorChannel(coordinator.address, TOKEN, rank=1, world_size=2, timeout=5)  # still serves
        channel.close()
