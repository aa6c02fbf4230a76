"""Wire protocol: round trips and every way a frame can be wrong."""
import json
import socket
import struct

import pytest

from model_parallel.coordinator import protocol as p
from model_parallel.errors import ProtocolError

TOKEN = b"secret"
NONCE = "ab" * 16


def frame(kind="heartbeat", seq=1, token=TOKEN, direction=p.C2S, nonce=NONCE, **fields):
    fields = fields or {"rank": 0, "step": 3}
    return p.encode_frame(p.make_message(kind, seq, **fields), token, direction, nonce)


def decode(data, last_seq=0, token=TOKEN, direction=p.C2S, nonce=NONCE):
    return p.decode_frame(data, token, direction, nonce, last_seq)


def raw(body: bytes, seq=1, token=TOKEN) -> bytes:
    mac = p.compute_mac(token, p.C2S, NONCE, seq, body)
    return p.HEADER.pack(len(mac) + 8 + len(body)) + mac + p.SEQ.pack(seq) + body


def test_round_trip_keeps_fields():
    message = decode(frame(seq=7))
    assert message == {"v": 1, "type": "heartbeat", "seq": 7, "rank": 0, "step": 3}


def test_report_round_trip():
    fields = dict(rank=1, step=4, stage=1, plan_version=2, step_ms=4.0, compute_ms=3.5, comm_ms=0.1, idle_ms=0.0, samples_per_s=10)
    assert decode(frame("report", **fields))["compute_ms"] == 3.5


def test_hello_is_unauthenticated():
    data = p.encode_frame(p.make_message("hello", 0, nonce=NONCE, server="x"), None, p.S2C, "")
    assert p.decode_frame(data, None, p.S2C, "")["nonce"] == NONCE


def test_truncated_frame():
    data = frame()
    with pytest.raises(ProtocolError, match="truncated frame: header says"):
        decode(data[:-3])
    with pytest.raises(ProtocolError, match="truncated frame: header has 2"):
        decode(data[:2])


def test_oversized_length_rejected_before_body():
    header = struct.pack(">I", p.MAX_FRAME_BYTES + 1)
    with pytest.raises(ProtocolError, match="exceeds the 1048576-byte limit"):
        p.parse_length(header)
    with pytest.raises(ProtocolError, match="too short"):
        p.parse_length(struct.pack(">I", 3))


def test_oversized_message_not_encoded():
    with pytest.raises(ProtocolError, match="exceeds the 1048576-byte frame limit"):
        frame("ctl", op="set-plan", args={"x": "y" * p.MAX_FRAME_BYTES})


def test_bad_json_and_non_object():
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode(raw(b"{not json"))
    with pytest.raises(ProtocolError, match="not UTF-8"):
        decode(raw(b"\xff\xfe{}"))
    with pytest.raises(ProtocolError, match="must be a JSON object, got list"):
        decode(raw(b"[1, 2]"))


def test_wrong_version():
    body = json.dumps({"v": 2, "type": "heartbeat", "seq": 1, "rank": 0, "step": 0}).encode()
    with pytest.raises(ProtocolError, match="protocol version 2 is not supported"):
        decode(raw(body))


def test_bad_mac_wrong_token_wrong_nonce_wrong_direction():
    data = frame()
    with pytest.raises(ProtocolError, match="authentication failed"):
        decode(data, token=b"other")
    with pytest.raises(ProtocolError, match="authentication failed"):
        decode(data, nonce="cd" * 16)
    with pytest.raises(ProtocolError, match="authentication failed"):
        decode(data, direction=p.S2C)
    tampered = bytearray(data)
    tampered[-3] ^= 1  # flip a bit of the body: '3' -> '2'
    with pytest.raises(ProtocolError, match="authentication failed"):
        decode(bytes(tampered))


def test_replayed_and_reordered_seq():
    assert decode(frame(seq=5), last_seq=4)["seq"] == 5
    with pytest.raises(ProtocolError, match="replayed or reordered frame: seq 5 after 5"):
        decode(frame(seq=5), last_seq=5)
    with pytest.raises(ProtocolError, match="seq 3 after 5"):
        decode(frame(seq=3), last_seq=5)


def test_unknown_type_and_bad_fields():
    body = json.dumps({"v": 1, "type": "launch_missiles", "seq": 1}).encode()
    with pytest.raises(ProtocolError, match="unknown message type 'launch_missiles'"):
        decode(raw(body))
    body = json.dumps({"v": 1, "type": "heartbeat", "seq": 1, "rank": 0}).encode()
    with pytest.raises(ProtocolError, match="heartbeat: missing field 'step'"):
        decode(raw(body))
    body = json.dumps({"v": 1, "type": "heartbeat", "seq": 1, "rank": "0", "step": 1}).encode()
    with pytest.raises(ProtocolError, match="field 'rank' must be int, got str"):
        decode(raw(body))
    body = json.dumps({"v": 1, "type": "heartbeat", "seq": 1, "rank": True, "step": 1}).encode()
    with pytest.raises(ProtocolError, match="got a bool"):
        decode(raw(body))
    body = json.dumps({"v": 1, "type": "heartbeat", "seq": "1", "rank": 0, "step": 1}).encode()
    with pytest.raises(ProtocolError, match="seq must be a non-negative integer"):
        decode(raw(body, seq=1))
    body = json.dumps({"v": 1, "type": "heartbeat", "seq": 9, "rank": 0, "step": 1}).encode()
    with pytest.raises(ProtocolError, match="body seq 9 differs from the frame's seq 1"):
        decode(raw(body, seq=1))
    with pytest.raises(ProtocolError, match="unknown op 'reboot'"):
        p.make_message("ctl", 1, op="reboot", args={})
    with pytest.raises(ProtocolError, match="unknown kind 'explode'"):
        p.make_message("command", 1, command={"kind": "explode"})
    with pytest.raises(ProtocolError, match="must be finite"):
        p.make_message("report", 1, rank=0, step=0, stage=0, plan_version=0, step_ms=0, compute_ms=float("nan"),
                       comm_ms=0, idle_ms=0, samples_per_s=0)


def test_parse_address_and_read_token(tmp_path, monkeypatch):
    assert p.parse_address("127.0.0.1:29600") == ("127.0.0.1", 29600)
    with pytest.raises(ProtocolError, match="is not HOST:PORT"):
        p.parse_address("localhost")
    assert p.read_token("t") == b"t"
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    assert p.read_token(token_file=str(token_file)) == b"s3cret"
    monkeypatch.delenv(p.TOKEN_ENV, raising=False)
    with pytest.raises(ProtocolError, match="no shared token"):
        p.read_token()
    with pytest.raises(ProtocolError, match="cannot read token file"):
        p.read_token(token_file=str(tmp_path / "missing"))


def test_socket_session_round_trip_and_trickle_timeout(monkeypatch):
    a, b = socket.socketpair()
    try:
        server = p.Session(a, TOKEN, NONCE, p.S2C)
        client = p.Session(b, TOKEN, NONCE, p.C2S)
        client.send("heartbeat", rank=2, step=9)
        assert server.recv(2.0)["step"] == 9
        server.send("reply", ok=True, result={"x": 1})
        assert client.recv(2.0)["result"] == {"x": 1}
        with pytest.raises(socket.timeout):  # nothing sent: a clean timeout, stream still usable
            server.recv(0.05)
        monkeypatch.setattr(p, "FRAME_TIMEOUT_S", 0.2)
        b.sendall(frame(seq=2)[:10])  # a frame that never completes
        with pytest.raises(ProtocolError, match="truncated frame: only 6 of"):
            server.recv(1.0)
        b.close()
        with pytest.raises((ConnectionError, ProtocolError)):
            server.recv(1.0)
    finally:
        a.close()
        b.close()
