"""Connecting to the coordinator: the authenticated handshake, hanging up, and `fetch_job` (a worker without a
model asks for the job). `client.py` builds the worker's channel and the ctl client on these."""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable

from model_parallel.coordinator.protocol import MAX_JOB_FRAME_BYTES, TOKEN_ENV, Session, client_handshake, parse_address
from model_parallel.errors import ProtocolError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
RECONNECT_FIRST_S = 0.25  # first wait before reconnecting; doubles per attempt (times a jitter in [0.5, 1])


class NotListening(ProtocolError):
    """Nothing listens at the coordinator's address (yet): the connection was refused."""


def _connect(address: str, token: bytes, timeout: float) -> Session:
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as error:
        kind = NotListening if isinstance(error, ConnectionRefusedError) else ProtocolError
        raise kind(f"cannot reach the coordinator at {address}: {error.strerror or error}; "
                   "is test_socket.py running there?") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client_handshake(sock, token, timeout)
    except (OSError, ProtocolError) as error:
        sock.close()
        raise ProtocolError(f"coordinator at {address}: handshake failed: {error}") from None


def connect_when_listening(address: str, token: bytes, timeout: float, wait_for: float, rank: int) -> Session:
    """`_connect`, retried while nothing listens at `address` for up to `wait_for` seconds (backoff 0.25 s doubling
    to 2 s): a coordinator started in the background a moment before its workers may not listen yet. Anything
    else (a name that does not resolve, a handshake that fails) is a ProtocolError at once, and so is a refusal
    after `wait_for`, naming the address and how long it waited."""
    deadline = time.monotonic() + wait_for
    delay, waiting = RECONNECT_FIRST_S, False
    while True:
        try:
            return _connect(address, token, timeout)
        except NotListening as error:
            if time.monotonic() + delay > deadline:
                if not waiting:
                    raise
                raise ProtocolError(f"rank {rank}: {error} (nothing listened there for {wait_for:.0f} s; start it "
                                    "first, or check --coordinator HOST:PORT)") from None
            if not waiting:
                logger.warning("rank %d: nothing listens at the coordinator's address %s yet (connection refused); "
                               "waiting up to %.0f s for it to start", rank, address, wait_for)
                waiting = True
        time.sleep(delay)
        delay = min(2 * delay, 2.0)


def check_token(address: str, token: bytes, timeout: float, wait_for: float, rank: int) -> None:
    """Before a worker joins the world: connect (waiting up to `wait_for` s while nothing listens) and have the
    coordinator answer an authenticated `probe`. A token that is not the coordinator's fails here, so the worker
    never joins and its peers name it as a rank that never joined, instead of it being refused at registration
    just after joining (its peers then waited --timeout for it)."""
    session = connect_when_listening(address, token, timeout, wait_for, rank)
    try:
        session.send("probe", rank=int(rank))
        reply = session.recv(timeout)
    except ConnectionError:  # before OSError: a clean close, not a timeout
        raise ProtocolError(f"the coordinator at {address} hung up on rank {rank}'s first message without an answer: "
                            "it drops a message signed with another token, so this worker's token is not the "
                            f"coordinator's; give both the same one (--token, --token-file or ${TOKEN_ENV}; the "
                            "coordinator's log says why it dropped the connection)") from None
    except (OSError, ProtocolError) as error:
        raise ProtocolError(f"coordinator at {address}: no answer to rank {rank}'s first message: {error}") from None
    finally:
        _hang_up(session)
    if reply["type"] != "reply" or not reply["ok"]:
        raise ProtocolError(f"coordinator at {address} refused rank {rank}: {reply.get('error', reply['type'])}")


def _hang_up(session: Session) -> None:
    try:
        session.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    session.sock.close()


def fetch_job(address: str, read_token: Callable[[], bytes], rank: int, timeout: float) -> tuple[dict[str, Any], bytes]:
    """Ask the coordinator for the job (a worker started without a model): its `job` message and the token that worked.

    Workers are often started before the coordinator (or read a token file it is about to replace), so a
    refused connection or a failed handshake is retried, re-reading the token, until `timeout` seconds
    have passed; then ProtocolError says what the last attempt saw.
    """
    deadline = time.monotonic() + timeout
    delay, last, told = RECONNECT_FIRST_S, "no attempt", False
    while True:
        try:
            token = read_token()  # again each time: the coordinator may be about to write a fresh token file
            session = _connect(address, token, min(CONNECT_TIMEOUT_S, max(deadline - time.monotonic(), 0.5)))
            try:
                session.send("job-request", rank=int(rank), host=socket.gethostname(), pid=os.getpid())
                reply = session.recv(CONNECT_TIMEOUT_S, max_bytes=MAX_JOB_FRAME_BYTES)
            finally:
                _hang_up(session)
        except (OSError, ProtocolError) as error:
            last = str(error) or type(error).__name__
        else:
            if reply["type"] == "job":
                return reply, token
            if reply["type"] == "reply" and not reply["ok"]:
                raise ProtocolError(f"coordinator at {address}: {reply.get('error', 'refused to send the job')}")
            raise ProtocolError(f"coordinator at {address}: expected the job, got {reply['type']!r}")
        if time.monotonic() + delay > deadline:
            raise ProtocolError(f"rank {rank}: could not get the job from the coordinator at {address} within "
                                f"{timeout:.0f} s: {last} (is test_socket.py running there, with the same token? "
                                "set $MODEL_PARALLEL_COORDINATOR=HOST:PORT if it runs elsewhere)")
        if not told:  # the wait was silent until the timeout: a coordinator on another port looked like a hang
            logger.warning("rank %d: no job from the coordinator at %s yet (%s); retrying for up to %.0f s (a "
                           "coordinator on another host or port: --coordinator HOST:PORT or $MODEL_PARALLEL_COORDINATOR)",
                           rank, address, last, timeout)
            told = True
        logger.debug("rank %d: the coordinator at %s is not ready (%s); retrying", rank, address, last)
        time.sleep(delay)
        delay = min(2 * delay, 2.0)
