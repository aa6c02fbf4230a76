"""The control-plane wire format: versioned, size-bounded, authenticated JSON frames over TCP.

Frame layout (all integers big-endian)::

    +-------------+----------------------+------------+---------------------------+
    | length: 4 B | mac: 32 B            | seq: 8 B   | body: length - 40 B       |
    | (the rest)  | HMAC-SHA256, below   | unsigned   | UTF-8 JSON object         |
    +-------------+----------------------+------------+---------------------------+

- `length` is at most `MAX_FRAME_BYTES` (1 MiB); a larger length is rejected *before* the body is
  read, so a hostile peer cannot make us allocate or wait for more. One exception: the `job` reply a
  worker asked its coordinator for (a whole graph.json) may be up to `MAX_JOB_FRAME_BYTES` (64 MiB);
  only that client, reading that one reply from the server it connected to, accepts it.
- `body` is a JSON object `{"v": 1, "type": "<type>", "seq": n, ...fields}`. `v` must equal
  `PROTOCOL_VERSION`; `type` must be one of `MESSAGE_FIELDS` and carry that type's fields.
- Every connection starts with the server sending an unauthenticated `hello` carrying a fresh
  random `nonce` (hex). Every later frame, in both directions, is authenticated:
  `mac = HMAC-SHA256(token, direction || nonce || seq (8 B) || body)` where `direction` is
  `b"c2s"` or `b"s2c"` (so a frame cannot be reflected back to its sender), and checked with
  `hmac.compare_digest` *before* the body is parsed (unauthenticated bytes never reach the JSON
  parser). The body's `seq` field must equal the header's.
- Both sides contribute a nonce. The client's first frame (`register`, `job-request` or `probe`, MAC'd
  under the server's nonce) carries the client's own fresh `nonce`; from then on, both ways, the
  MAC's nonce is `server nonce || client nonce`. So frames recorded on one connection fail on any
  other: a server frame replayed to a client by a proxy without the token (an old `switch`, `job`,
  `stop`) fails the client's MAC check, as a client frame replayed to the server fails the server's.
- `seq` starts at 1 and must strictly increase on each direction of a connection: a replayed or
  reordered frame is rejected.
- Anything else — truncated frame, oversized length, bad UTF-8/JSON, JSON nested deeper than 64
  levels or with an integer of more than 64 digits or a non-finite number, wrong version, bad MAC,
  replayed seq, unknown type, missing/ill-typed field — raises `ProtocolError`; the server then
  drops that connection (and only that one).

No pickle anywhere: JSON only. Plans travel as `Plan.to_dict()`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Optional

from model_parallel import jsonbound
from model_parallel.errors import ProtocolError
from model_parallel.userfile import read_text

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
MAX_JOB_FRAME_BYTES = 64 << 20  # a `job` reply carries a graph.json (tens of MB for a very large model)
MAX_TOKEN_FILE_BYTES = 1 << 16  # a secret is a line of tens of bytes; a bigger "token file" is the wrong file
MAC_BYTES = 32
HEADER = struct.Struct(">I")
SEQ = struct.Struct(">Q")
PREFIX_BYTES = MAC_BYTES + SEQ.size
C2S = b"c2s"  # client -> server
S2C = b"s2c"  # server -> client

_NUM = (int, float)
# type -> {field: accepted python types}; bool is rejected where a number is expected (see _check).
MESSAGE_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    # server -> client, unauthenticated, first frame of every connection
    "hello": {"nonce": (str,), "server": (str,)},
    # client -> server: who am I. role "worker" needs rank/world_size; role "ctl" needs nothing else.
    # `nonce` (also in job-request): the client's half of the session nonce (see the module docstring).
    "register": {"role": (str,), "rank": (int,), "host": (str,), "pid": (int,), "world_size": (int,), "nonce": (str,),
                 "instance": (str,), "schedule": (str,), "checkpoint_dir": (str,),
                 # --schedule auto: `schedule` is the one it chose, which a live switch may choose again for the
                 # new plan (coordinator/rechoose.py) from m = `num_microbatches`
                 "schedule_auto": (bool,), "num_microbatches": (int,), "schedule_order": (str,),
                 # what the worker runs (a fresh coordinator learns the live job from them): the plan version of
                 # its last report (or its start), that plan when the worker knows it, its furthest step
                 "live_version": (int,), "live_plan": (dict,), "step": (int,),
                 # --recover: the membership generation (0: the world joined at start) and, from 1 on, how it
                 # came about: {"members": [original ranks], "lost": [...], "from_step": first step run}
                 "generation": (int,), "membership": (dict,),
                 # the worker's --timeout (s): a rank recovering (--recover) may take a few of them to come back
                 "peer_timeout": (float, int)},
    # server -> client: registration accepted; the live plan (dict) and its version; `issued`: the newest plan
    # version this coordinator has spent (a re-formed world numbers its plan above it)
    "welcome": {"plan_version": (int,), "plan": (dict,), "issued": (int,)},
    "heartbeat": {"rank": (int,), "step": (int,)},
    # per-rank per-step report: a `model_parallel.messages.StepReport` as its `to_dict()` (ms; stage null on a
    # spare rank). Only the types are checked here; `StepReport.from_dict` refuses absurd values on the server.
    "report": {
        "rank": (int,), "step": (int,), "stage": (int, type(None)), "plan_version": (int,), "step_ms": _NUM,
        "compute_ms": _NUM, "comm_ms": _NUM, "idle_ms": _NUM, "samples_per_s": _NUM, "loss": (int, float, type(None)),
    },
    # server -> worker: a `model_parallel.messages.Command` as its `to_dict()`:
    # kind "switch" (plan), "stop" (reason) or "slowdown" (rank, factor)
    "command": {"command": (dict,)},
    # ctl client -> server: op status|rebalance|set-plan|scale|slow, with args
    "ctl": {"op": (str,), "args": (dict,)},
    # server -> ctl client
    "reply": {"ok": (bool,), "result": (dict,), "error": (str,)},
    # rank 0 -> server: every rank refused the switch to plan `version` before moving anything (why: `reason`);
    # the job goes on with the plan it ran
    "switch-refused": {"version": (int,), "reason": (str,)},
    # rank 0 -> server: the switch to plan `version` failed on rank `rank` (the lowest that failed) after it
    # started; every rank rolled back to the plan it ran and the job goes on (`reason`: "rank r: cause; ...")
    "switch-failed": {"version": (int,), "rank": (int,), "reason": (str,)},
    # client -> server: the worker finished (or is stopping) on purpose
    "bye": {"rank": (int,), "reason": (str,)},
    # client -> server, instead of register: a worker about to join the world checks that its token is the
    # coordinator's (answered by an ok `reply`; a frame signed with another token is dropped unanswered)
    "probe": {"rank": (int,), "nonce": (str,)},
    # client -> server, instead of register: a worker started without a model asks what to train
    "job-request": {"rank": (int,), "host": (str,), "pid": (int,), "nonce": (str,)},
    # server -> client: graph.json and plan.json as objects, the plan's version, and worker flags
    # (`train`: {flag: value}, e.g. {"batch_size": 8}) that the worker's own command line overrides
    "job": {"graph": (dict,), "plan": (dict,), "plan_version": (int,), "train": (dict,)},
}
# Fields a message may omit (e.g. a ctl client's register has no rank).
OPTIONAL_FIELDS: dict[str, frozenset[str]] = {
    "register": frozenset({"rank", "host", "pid", "world_size", "nonce", "instance", "schedule", "checkpoint_dir",
                           "schedule_auto", "num_microbatches", "schedule_order",
                           "live_version", "live_plan", "step", "generation", "membership", "peer_timeout"}),
    "welcome": frozenset({"issued"}),
    "reply": frozenset({"result", "error"}),
    "report": frozenset({"loss"}),
    "job-request": frozenset({"rank", "host", "pid", "nonce"}),
}
COMMAND_KINDS = ("switch", "stop", "slowdown")
CTL_OPS = ("status", "rebalance", "set-plan", "scale", "slow")
ROLES = ("worker", "ctl")


def new_nonce() -> str:
    return os.urandom(16).hex()


def is_nonce(text: Any) -> bool:
    """32 lowercase hex digits, as `new_nonce` makes."""
    return isinstance(text, str) and len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def compute_mac(token: bytes, direction: bytes, nonce: str, seq: int, body: bytes) -> bytes:
    return hmac.new(token, direction + nonce.encode("ascii", "replace") + SEQ.pack(seq) + body, hashlib.sha256).digest()


def _check(message: dict[str, Any]) -> dict[str, Any]:
    """Validate version, type and fields of a decoded body; return it unchanged."""
    if message.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {message.get('v')!r} is not supported (this side speaks {PROTOCOL_VERSION}); "
                            "run the same model_parallel version on coordinator and workers")
    kind = message.get("type")
    if kind not in MESSAGE_FIELDS:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {sorted(MESSAGE_FIELDS)}")
    seq = message.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**64:
        raise ProtocolError(f"{kind}: seq must be a non-negative integer, got {seq!r}")
    optional = OPTIONAL_FIELDS.get(kind, frozenset())
    for name, types in MESSAGE_FIELDS[kind].items():
        if name not in message:
            if name in optional:
                continue
            raise ProtocolError(f"{kind}: missing field {name!r}")
        value = message[name]
        if isinstance(value, bool) and bool not in types:
            raise ProtocolError(f"{kind}: field {name!r} must be {'/'.join(t.__name__ for t in types)}, got a bool")
        if not isinstance(value, types):
            raise ProtocolError(f"{kind}: field {name!r} must be {'/'.join(t.__name__ for t in types)}, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(f"{kind}: field {name!r} must be finite, got {value}")
    if kind == "command" and message["command"].get("kind") not in COMMAND_KINDS:
        raise ProtocolError(f"command: unknown kind {message['command'].get('kind')!r}; expected one of {COMMAND_KINDS}")
    if kind == "ctl" and message["op"] not in CTL_OPS:
        raise ProtocolError(f"ctl: unknown op {message['op']!r}; expected one of {CTL_OPS}")
    if kind == "register" and message["role"] not in ROLES:
        raise ProtocolError(f"register: unknown role {message['role']!r}; expected one of {ROLES}")
    return message


def make_message(kind: str, seq: int = 0, **fields: Any) -> dict[str, Any]:
    return _check({"v": PROTOCOL_VERSION, "type": kind, "seq": seq, **fields})


def _frame_limit(kind: Any) -> int:
    return MAX_JOB_FRAME_BYTES if kind == "job" else MAX_FRAME_BYTES


def encode_body(message: dict[str, Any]) -> bytes:
    try:
        body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"{message.get('type')}: cannot encode message as JSON ({error})") from None
    limit = _frame_limit(message.get("type"))
    if len(body) + PREFIX_BYTES > limit:
        raise ProtocolError(f"{message.get('type')}: message of {len(body)} bytes exceeds the {limit}-byte frame limit")
    return body


def encode_frame(message: dict[str, Any], token: Optional[bytes], direction: bytes, nonce: str) -> bytes:
    """A complete frame (header + mac + body). `token=None` sends an unauthenticated frame (hello only)."""
    _check(message)
    body = encode_body(message)
    seq = message["seq"]
    mac = compute_mac(token, direction, nonce, seq, body) if token is not None else bytes(MAC_BYTES)
    return HEADER.pack(PREFIX_BYTES + len(body)) + mac + SEQ.pack(seq) + body


def parse_length(header: bytes, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """The payload length from a 4-byte header; rejects short headers and oversized/undersized lengths."""
    if len(header) != HEADER.size:
        raise ProtocolError(f"truncated frame: header has {len(header)} of {HEADER.size} bytes")
    (length,) = HEADER.unpack(header)
    if length > max_bytes:
        raise ProtocolError(f"frame length {length} exceeds the {max_bytes}-byte limit; refusing to read it")
    if length < PREFIX_BYTES + 2:
        raise ProtocolError(f"frame length {length} is too short for a MAC, a seq and a JSON body")
    return length


def decode_payload(payload: bytes, token: Optional[bytes], direction: bytes, nonce: str, last_seq: int,
                   max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Check the MAC (unless `token` is None: hello), then parse and validate the body.

    `last_seq` is the highest sequence number accepted so far on this direction; a frame must exceed it.
    """
    if len(payload) < PREFIX_BYTES + 2:
        raise ProtocolError(f"truncated frame: payload of {len(payload)} bytes has no room for MAC, seq and body")
    mac, body = payload[:MAC_BYTES], payload[PREFIX_BYTES:]
    (seq,) = SEQ.unpack(payload[MAC_BYTES:PREFIX_BYTES])
    if token is not None:
        # Authenticate before looking at the body at all.
        if not hmac.compare_digest(mac, compute_mac(token, direction, nonce, seq, body)):
            raise ProtocolError("authentication failed: bad MAC (wrong token, or a frame from another connection)")
        if seq <= last_seq:
            raise ProtocolError(f"replayed or reordered frame: seq {seq} after {last_seq}")
    # Bounded decoding: the hello is unauthenticated, so a 5000-digit integer or [[[[...]]]] from
    # anyone who can connect must be a ProtocolError, never a ValueError/RecursionError in a worker.
    message = jsonbound.loads(body, where=f"{'hello' if token is None else 'frame'} body", error=ProtocolError,
                              fix="is the peer a model_parallel coordinator/worker of the same version?")
    if not isinstance(message, dict):
        raise ProtocolError(f"frame body must be a JSON object, got {type(message).__name__}")
    if len(payload) > MAX_FRAME_BYTES and message.get("type") != "job":  # only a job reply may be larger
        raise ProtocolError(f"a {message.get('type')!r} frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    _check(message)
    if message["seq"] != seq:
        raise ProtocolError(f"body seq {message['seq']} differs from the frame's seq {seq}")
    return message


def decode_frame(frame: bytes, token: Optional[bytes], direction: bytes, nonce: str, last_seq: int = 0) -> dict[str, Any]:
    """Decode one complete frame (header included); any defect raises `ProtocolError`."""
    length = parse_length(frame[: HEADER.size])
    payload = frame[HEADER.size:]
    if len(payload) != length:
        raise ProtocolError(f"truncated frame: header says {length} bytes, got {len(payload)}")
    return decode_payload(payload, token, direction, nonce, last_seq)


# ---- sockets ---------------------------------------------------------------------------------------
FRAME_TIMEOUT_S = 5.0  # once a frame has started, all of it must arrive within this


def _recv_exactly(sock: socket.socket, count: int, deadline: float, started: bool) -> bytes:
    chunks: list[bytes] = []
    remaining = count
    while remaining:
        left = deadline - time.monotonic()
        if left <= 0:
            if started or remaining != count:
                raise ProtocolError(f"truncated frame: only {count - remaining} of {count} bytes arrived in time")
            raise socket.timeout("no frame arrived in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(remaining, 65536))
        except socket.timeout:
            continue
        if not chunk:
            if remaining == count and not started:
                raise ConnectionError("connection closed by peer")
            raise ProtocolError(f"truncated frame: connection closed after {count - remaining} of {count} bytes")
        if not started:
            # The frame has begun: the rest must follow promptly (a trickling peer is cut off).
            started = True
            deadline = time.monotonic() + FRAME_TIMEOUT_S
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_payload(sock: socket.socket, timeout: float, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Read one frame's payload (mac + body).

    `socket.timeout` if no frame starts within `timeout` (the stream stays usable),
    `ConnectionError` on a clean close between frames, `ProtocolError` on a bad header, a cut
    frame, or a frame that does not complete within `FRAME_TIMEOUT_S` of its first byte.
    """
    header = _recv_exactly(sock, HEADER.size, time.monotonic() + timeout, started=False)
    length = parse_length(header, max_bytes)
    # A job reply of up to 64 MiB gets more than FRAME_TIMEOUT_S (1 s more per 2 MiB, for a slow link).
    extra = length / (2 << 20) if length > MAX_FRAME_BYTES else 0.0
    return _recv_exactly(sock, length, time.monotonic() + FRAME_TIMEOUT_S + extra, started=True)


@dataclass
class Session:
    """One side of one connection: the nonce, the token, and both sequence counters."""

    sock: socket.socket
    token: bytes
    nonce: str
    send_direction: bytes
    send_seq: int = 0
    recv_seq: int = 0
    timeout: float = 5.0
    client_nonce: str = ""  # a client's half of the session nonce: its first frame carries it

    @property
    def recv_direction(self) -> bytes:
        return C2S if self.send_direction == S2C else S2C

    def send(self, kind: str, **fields: Any) -> None:
        first = self.send_seq == 0 and bool(self.client_nonce)
        if first:
            fields = {**fields, "nonce": self.client_nonce}
        self.send_seq += 1
        frame = encode_frame(make_message(kind, self.send_seq, **fields), self.token, self.send_direction, self.nonce)
        self.sock.settimeout(self.timeout)
        self.sock.sendall(frame)
        if first:  # every later frame, both ways, is bound to both nonces
            self.nonce += self.client_nonce

    def bind_client(self, first: dict[str, Any]) -> None:
        """Server side: take the client's nonce from its first (authenticated) frame; ProtocolError if it has none."""
        if not is_nonce(first.get("nonce")):
            raise ProtocolError(f"{first.get('type')}: the client's first frame must carry its own nonce (32 hex digits), "
                                f"got {str(first.get('nonce'))[:40]!r}; run the same model_parallel version everywhere")
        self.nonce += first["nonce"]

    def recv(self, timeout: Optional[float] = None, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
        """The next authenticated message; `max_bytes` above 1 MiB only where a `job` reply is awaited."""
        payload = recv_payload(self.sock, self.timeout if timeout is None else timeout, max_bytes)
        message = decode_payload(payload, self.token, self.recv_direction, self.nonce, self.recv_seq, max_bytes)
        self.recv_seq = message["seq"]
        return message


def client_handshake(sock: socket.socket, token: bytes, timeout: float) -> Session:
    """Read the server's hello and return a client-side session bound to its nonce."""
    hello = decode_payload(recv_payload(sock, timeout), None, S2C, "", 0)
    if hello["type"] != "hello":
        raise ProtocolError(f"expected hello from the coordinator, got {hello['type']!r}")
    if not is_nonce(hello["nonce"]):
        raise ProtocolError(f"the coordinator's hello carries a malformed nonce {hello['nonce'][:40]!r} (expected 32 hex digits)")
    return Session(sock, token, hello["nonce"], C2S, timeout=timeout, client_nonce=new_nonce())


# ---- addresses and tokens ------------------------------------------------------------------------
TOKEN_ENV = "MODEL_PARALLEL_TOKEN"


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")  # [::1]:29600
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ProtocolError(f"coordinator address {text!r} is not HOST:PORT (e.g. 127.0.0.1:29600)")
    return host, int(port)


def read_token(token: Optional[str] = None, token_file: Optional[str] = None, default_file: Optional[str] = None) -> bytes:
    """The shared secret from --token, else --token-file (first line), else $MODEL_PARALLEL_TOKEN, else
    `default_file` (a worker: the token file a coordinator on this machine wrote, coordinator.jobfiles)."""
    if token is not None and token_file is not None:
        raise ProtocolError("give --token or --token-file, not both")
    if token_file is not None:
        text = read_text(token_file, error=ProtocolError, what="token file", max_bytes=MAX_TOKEN_FILE_BYTES,
                         fix="write the shared secret on its first line")
        token = text.split("\n", 1)[0].strip()
        if not token:
            raise ProtocolError(f"{token_file}: the token file is empty; write the shared secret on its first line")
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    if not token and default_file is not None and os.path.isfile(default_file):
        return read_token(None, default_file)
    if not token:
        where = f"; no coordinator on this machine wrote {default_file} either" if default_file else ""
        raise ProtocolError(f"no shared token: pass --token-file F or set ${TOKEN_ENV} (or --token T, visible in `ps`){where}")
    return token.encode("utf-8")
