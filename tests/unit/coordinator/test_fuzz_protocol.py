"""Fuzz the control-plane frame decoder: garbage, truncated, oversized, forged and replayed frames are
`ProtocolError`s, never another exception, and a valid frame still decodes after the noise."""
from __future__ import annotations

import json
import os
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from model_parallel.coordinator import protocol
from model_parallel.errors import ModelParallelError, ProtocolError

TOKEN = b"fuzz-token"
NONCE = "00" * 16
DEEP = int(os.environ.get("MP_FUZZ_EXAMPLES", "0"))  # see test_fuzz.py
FUZZ = settings(max_examples=DEEP or 300, deadline=None, derandomize=not DEEP, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def valid_frame(seq: int = 1) -> bytes:
    message = protocol.make_message("heartbeat", seq, rank=1, step=7)
    return protocol.encode_frame(message, TOKEN, protocol.C2S, NONCE)


def decode(frame: bytes, token: Any = TOKEN, last_seq: int = 0) -> Any:
    try:
        return protocol.decode_frame(frame, token, protocol.C2S, NONCE, last_seq)
    except ModelParallelError as error:
        assert isinstance(error, ProtocolError), f"expected ProtocolError, got {type(error).__name__}: {error}"
        return error


def test_valid_frame_roundtrips() -> None:
    message = decode(valid_frame())
    assert message["type"] == "heartbeat" and message["rank"] == 1 and message["step"] == 7


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_are_protocol_errors(data: bytes) -> None:
    assert isinstance(decode(data), ProtocolError)
    assert isinstance(decode(data, token=None), (ProtocolError, dict))


@pytest.mark.slow
@FUZZ
@given(st.data())
def test_mutated_frames_are_rejected(data: st.DataObject) -> None:
    frame = bytearray(valid_frame())
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "length"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        frame = frame[: data.draw(st.integers(0, len(frame) - 1))]
    elif kind == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=20))
    else:
        frame[:4] = struct.pack(">I", data.draw(st.integers(0, 2**32 - 1).filter(lambda n: n != len(frame) - 4)))
    assume(bytes(frame) != valid_frame())  # two flips of one byte can cancel out
    # A changed frame must never decode: the MAC covers the body, the header fixes the length.
    assert isinstance(decode(bytes(frame)), ProtocolError)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)


@st.composite
def bodies(draw: st.DrawFn) -> dict:
    """Bodies near the schema: a real type and version, fields random, so the field checks get exercised."""
    kind = draw(st.sampled_from(sorted(protocol.MESSAGE_FIELDS)))
    body: dict[str, Any] = {"v": draw(st.sampled_from([1, 1, 1, 2, "1", True])), "type": kind, "seq": draw(st.integers(-2, 5) | JSON)}
    for name in protocol.MESSAGE_FIELDS[kind]:
        if draw(st.integers(0, 4)):
            body[name] = draw(JSON | st.sampled_from(["switch", "stop", "worker", "ctl", "status", {"kind": "stop"}, {"kind": 1}]))
    return body


@pytest.mark.slow
@FUZZ
@given(bodies())
def test_authenticated_bodies_decode_or_raise(body: dict) -> None:
    """Correctly signed but ill-formed bodies (a buggy peer with the right token) are still checked."""
    raw = json.dumps(body).encode()
    seq = body["seq"] if isinstance(body["seq"], int) and not isinstance(body["seq"], bool) and body["seq"] >= 0 else 0
    frame = protocol.HEADER.pack(protocol.MAC_BYTES + len(raw)) + protocol.compute_mac(TOKEN, protocol.C2S, NONCE, seq, raw) + raw
    result = decode(frame)
    if isinstance(result, dict):
        assert result["type"] in protocol.MESSAGE_FIELDS and result["v"] == protocol.PROTOCOL_VERSION


def test_wrong_token_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="authentication failed"):
        protocol.decode_frame(valid_frame(), b"other-token", protocol.C2S, NONCE, 0)


def test_replayed_frame_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="replayed"):
        protocol.decode_frame(valid_frame(seq=3), TOKEN, protocol.C2S, NONCE, 3)


def test_reflected_frame_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="authentication failed"):
        protocol.decode_frame(valid_frame(), TOKEN, protocol.S2C, NONCE, 0)


def test_oversized_length_rejected_before_reading() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.parse_length(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("token", [TOKEN, None], ids=["authenticated", "hello"])
def test_deeply_nested_body_is_protocol_error(token: Any) -> None:
    # Within the size limit, but nested deeper than json's recursion allows: an unauthenticated peer
    # must not be able to raise RecursionError in the coordinator.
    raw = b"[" * 200_000 + b"]" * 200_000
    frame = protocol.HEADER.pack(protocol.MAC_BYTES + len(raw)) + bytes(protocol.MAC_BYTES) + raw
    with pytest.raises(ProtocolError):
        protocol.decode_frame(frame, token, protocol.C2S, NONCE, 0)


@pytest.mark.parametrize("token", [TOKEN, None], ids=["authenticated", "hello"])
@pytest.mark.parametrize("body", [b'{"v": 1, "type": "hello", "seq": 0, "nonce": ' + b"9" * 5000 + b', "server": "x"}',
                                  b'{"v": 1, "type": "hello", "seq": 0, "nonce": "a", "server": 1e999}',
                                  b'{"v": 1, "type": "hello", "seq": 0, "nonce": "a", "server": ' + b"[" * 70 + b"]" * 70 + b"}"],
                         ids=["huge-int", "overflowing-float", "deep"])
def test_unbounded_numbers_and_depth_are_protocol_errors(token: Any, body: bytes) -> None:
    # A >4300-digit integer raised a bare ValueError from json.loads: an unauthenticated hello crashed the worker.
    mac = protocol.compute_mac(TOKEN, protocol.C2S, NONCE, 0, body) if token else bytes(protocol.MAC_BYTES)
    frame = protocol.HEADER.pack(protocol.PREFIX_BYTES + len(body)) + mac + protocol.SEQ.pack(0) + body
    with pytest.raises(ProtocolError, match="hello body|frame body"):
        protocol.decode_frame(frame, token, protocol.C2S, NONCE, -1)


def test_hostile_hello_from_a_fake_coordinator_is_a_protocol_error() -> None:
    """A client (worker or ctl) that connects to a hostile server gets one ProtocolError, not a traceback."""
    import socket
    import threading

    from model_parallel.coordinator.client import CtlClient

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(10)

    def serve() -> None:
        conn, _ = listener.accept()
        body = b'{"v": 1, "type": "hello", "seq": 0, "nonce": "00", "server": ' + b"1" * 5000 + b"}"
        conn.sendall(protocol.HEADER.pack(protocol.PREFIX_BYTES + len(body)) + bytes(protocol.MAC_BYTES) + protocol.SEQ.pack(0) + body)
        conn.recv(1)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(ProtocolError, match="handshake failed: hello body:1: an integer of 5000 digits"):
            CtlClient(f"127.0.0.1:{listener.getsockname()[1]}", TOKEN, timeout=5)
    finally:
        listener.close()
        thread.join(5)


@pytest.mark.slow
@FUZZ
@given(st.text(max_size=30) | st.from_regex(r"[a-z0-9.\[\]:]{0,12}:[0-9²١]{0,7}", fullmatch=True))
def test_parse_address_parses_or_raises(text: str) -> None:
    try:
        host, port = protocol.parse_address(text)
    except ProtocolError:
        return
    assert host and 0 < port < 65536


@pytest.mark.parametrize("text", ["[:1", "[]:29600"])
def test_parse_address_rejects_an_empty_bracketed_host(text: str) -> None:
    with pytest.raises(ProtocolError, match="not HOST:PORT"):
        protocol.parse_address(text)
