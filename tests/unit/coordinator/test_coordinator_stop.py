"""`Coordinator.stop` ends every connection thread before it returns: none outlives the coordinator (one that
logged after its test's streams closed printed a traceback to stderr during tests/unit/cli/test_seed_cli.py)."""
import socket
import threading
import time

from model_parallel.coordinator.server import HANDSHAKE_TIMEOUT_S, Coordinator
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan


def _connection_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("coordinator-conn-") and t.is_alive()]


def test_stop_closes_a_connection_still_in_its_handshake_and_waits_for_its_thread() -> None:
    graph = Graph((Node("input0", "Input0"), Node("n0", "Linear", forward_ms=1.0)), (("input0", "n0"),))
    coordinator = Coordinator(graph, Plan((StagePlan(0, ("input0", "n0"), ranks=(0,)),)), b"token")
    port = coordinator.start("127.0.0.1", 0)
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        client.recv(1)  # the coordinator's hello: its connection thread now waits for our first frame
        deadline = time.monotonic() + 5
        while not _connection_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _connection_threads(), "the connection thread did not start"
        # Closed, not left to time out: stop() returns well within the handshake timeout (no clock read:
        # a thread that is still alive after that long is the failure).
        stopping = threading.Thread(target=coordinator.stop, daemon=True)
        stopping.start()
        stopping.join(timeout=HANDSHAKE_TIMEOUT_S)
        assert not stopping.is_alive(), f"Coordinator.stop waited out the {HANDSHAKE_TIMEOUT_S} s handshake timeout"
        assert not _connection_threads(), "a connection thread outlived Coordinator.stop"
    finally:
        client.close()
