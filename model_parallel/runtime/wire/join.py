"""A worker joining a running job (`--join HOST:PORT`): the keys it and the job's rank 0 exchange in the store.

The store is the base store of the job's current generation (recovery.py: rank 0's --dist_addr:--dist_port, or
the lowest survivor's at --dist_port + g once the first host was lost). Its keys, none of them prefixed:

- `mp/job/flags`: the job's flags as JSON, written by the current rank 0 at every world it forms, with whether it
  runs under `--recover` (only such a job can admit anyone). A joiner compares its own flags with them first.
- `mp/job/training`: the training record rank 0's engine would write into a checkpoint (its graph's structure, its
  data's fingerprint), written once the engine of each world is built: a joiner's own graph and data are compared
  with it (cli/join_data.py).
- `mp/join/request`: the one request slot. "" or absent: free; a JSON request {"address", "nonce"}: pending;
  "taken": rank 0 is admitting someone. A joiner claims it with compare-and-set from "", so two joiners never
  overwrite each other; rank 0 takes it with compare-and-set from the request it read, so a joiner that gave
  up (withdrawn by compare-and-set back to "") is never admitted.
- `mp/join/admit/<nonce>`: what rank 0 tells the joiner it took: the generation to meet in, the members, every
  original rank's address and the original rank the joiner gets (always the next unused one: it is the last).
Nothing read here is executed: JSON only, every field checked.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import DistNetworkError

from model_parallel import jsonbound
from model_parallel.errors import PeerError, ProtocolError
from model_parallel.graph.hierarchy import MAX_RANKS

FLAGS = "mp/job/flags"
TRAINING = "mp/job/training"  # rank 0's training record (publish_training)
REQUEST = "mp/join/request"
ADMIT = "mp/join/admit/{}"
TAKEN = "taken"
logger = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 1 << 16  # {"address": ..., "nonce": ...} is about 100 bytes
MAX_ADMISSION_BYTES = MAX_FLAGS_BYTES = 1 << 24  # an admission lists every rank's address: 65536 x ~60 bytes
MAX_FIELD_CHARS = 1024  # a nonce (32 hex digits) or a HOST:PORT address
MAX_GENERATION = 1 << 31  # one generation per recovery or admission


@dataclass(frozen=True)
class Admission:
    """Where and as whom a joiner meets the running ranks (rank 0 decides it, every rank and the joiner read it)."""

    nonce: str
    address: str  # the joiner's address, for later generations' store-host rule
    original: int  # the original rank the joiner gets (the next unused one)
    generation: int  # the generation the N+1 members meet in
    members: tuple[int, ...]  # the original ranks of the world that admits (the joiner not included)
    addresses: tuple[str, ...]  # every original rank's address before the joiner's
    base_port: int
    store_host: int
    store_port: int

    def to_json(self) -> str:
        return json.dumps({"nonce": self.nonce, "address": self.address, "original": self.original,
                           "generation": self.generation, "members": list(self.members),
                           "addresses": list(self.addresses), "base_port": self.base_port,
                           "store_host": self.store_host, "store_port": self.store_port})

    @classmethod
    def from_json(cls, text: str) -> "Admission":
        """An admission read from the store (any store client can write a key) or a coordinator's command: bounded
        JSON, every number an integer in its range (`1e999`, `Infinity`, `true`, a port of 10^9 are refused, an
        OverflowError or a later bind failure before), one ProtocolError naming it."""
        where = f"join admission {text[:120]!r}"
        d = jsonbound.loads(text, where="join admission", error=ProtocolError, max_bytes=MAX_ADMISSION_BYTES,
                            fix=f"got {text[:120]!r}")
        try:
            def number(key: str, low: int, high: int) -> int:
                value = jsonbound.json_number(d[key], key, integer=True)
                if not low <= value <= high:
                    raise ValueError(f"{key} must be in {low}..{high}, got {value}")
                return int(value)

            def text_of(value: Any, key: str) -> str:
                if not isinstance(value, str) or not 0 < len(value) <= MAX_FIELD_CHARS or not value.isprintable():
                    raise ValueError(f"{key} must be a printable string of 1..{MAX_FIELD_CHARS} characters")
                return value

            if not isinstance(d["members"], list) or not isinstance(d["addresses"], list):
                raise TypeError("members and addresses must be lists")
            out = cls(text_of(d["nonce"], "nonce"), text_of(d["address"], "address"),
                      number("original", 0, MAX_RANKS - 1), number("generation", 1, MAX_GENERATION),
                      tuple(int(jsonbound.json_number(m, "a member", integer=True)) for m in d["members"]),
                      tuple(text_of(a, "an address") for a in d["addresses"]),
                      number("base_port", 1, 65535), number("store_host", 0, MAX_RANKS - 1),
                      number("store_port", 1, 65535))
        except (ValueError, KeyError, TypeError) as error:
            raise ProtocolError(f"malformed {where}: {error}") from None
        if out.original != len(out.addresses) or out.original in out.members:
            raise ProtocolError(f"{where}: the joiner's original rank must be the next unused one")
        if len(set(out.members)) != len(out.members) or not all(0 <= m < out.original for m in out.members):
            raise ProtocolError(f"{where}: the members must be distinct original ranks below the joiner's")
        return out


def publish_flags(store: Any, flags: dict[str, Any], recover: bool, backend: str) -> None:
    """Rank 0 of every world: what a joiner compares its flags with."""
    # default=str: a flag value JSON cannot hold is compared as its text (never a failure of the job)
    store.set(FLAGS, json.dumps({"recover": recover, "backend": backend, "flags": flags}, sort_keys=True, default=str))


def read_flags(store: Any, seconds: float) -> Optional[dict[str, Any]]:
    """The running job's published flags ({"recover", "flags"}), None when none appear within `seconds` (a store
    that closes the connection raises: the caller names it, it is no "nobody published")."""
    data = _read_published(store, FLAGS, seconds, "flags")
    return data if isinstance(data, dict) and isinstance(data.get("flags"), dict) else None


def publish_training(store: Any, record: dict[str, Any]) -> None:
    """Rank 0 of every world, once its engine is built: the training record a checkpoint of it would hold (the graph's
    structure, the data's fingerprint: runtime/checkpoint/training_record.py). A joiner compares its own graph and data
    with it before it asks to be admitted, also before the job committed any checkpoint (cli/join_data.py)."""
    store.set(TRAINING, json.dumps(record, sort_keys=True, default=str))


def read_training(store: Any, seconds: float) -> Optional[dict[str, Any]]:
    """The record `publish_training` wrote, None when none appears within `seconds` (or it is unreadable)."""
    data = _read_published(store, TRAINING, seconds, "training record")
    return data if isinstance(data, dict) else None


def _read_published(store: Any, key: str, seconds: float, what: str) -> Any:
    try:
        store.wait([key], timedelta(seconds=seconds))
    except DistNetworkError:
        raise
    except Exception:  # noqa: BLE001 - the store's own timeout: nobody published
        return None
    try:  # any store client can write the key: nested 100 000 deep was a RecursionError, reported as a store failure
        return jsonbound.loads(store.get(key), where=key, error=ProtocolError, max_bytes=MAX_FLAGS_BYTES)
    except ProtocolError as error:
        logger.warning("the job's published %s are unreadable, read as none published: %s", what, error)
        return None


def post_request(store: Any, address: str, deadline: float) -> str:
    """Claim the request slot (waiting while another joiner holds it, until `deadline`); returns the nonce."""
    nonce = uuid.uuid4().hex
    mine = json.dumps({"address": address, "nonce": nonce})
    while True:
        if store.compare_set(REQUEST, "", mine).decode() == mine:
            return nonce
        if time.monotonic() > deadline:
            raise PeerError("another worker's join request held the request slot until the deadline; retry later")
        time.sleep(0.2)


def wait_admission(store: Any, nonce: str, deadline: float) -> Optional[Admission]:
    """The admission rank 0 wrote for `nonce`, or None at `deadline` (then the request is withdrawn, unless rank 0
    took it in the meantime: then the admission is waited for a little longer, it is being written)."""
    key, extended = ADMIT.format(nonce), False
    while True:
        if store.check([key]):
            return Admission.from_json(store.get(key).decode())
        if time.monotonic() > deadline:
            current = store.get(REQUEST).decode() if store.check([REQUEST]) else ""
            if _nonce(current) == nonce:  # ours, still pending: withdrawn, so never admitted later
                if store.compare_set(REQUEST, current, "").decode() == "":
                    return None
                continue  # rank 0 took it just now: its admission follows
            if current != TAKEN or extended:
                return None  # taken, and no admission written since (rank 0 died in between): none is coming
            deadline, extended = time.monotonic() + 5.0, True  # taken: rank 0 writes the admission right after
        time.sleep(0.2)


def _nonce(text: str) -> str:
    if not text:  # the slot is free
        return ""
    try:  # the request slot: any store client can write it (bounded: no RecursionError)
        request = jsonbound.loads(text, where=REQUEST, error=ProtocolError, max_bytes=MAX_REQUEST_BYTES)
    except ProtocolError as error:
        logger.warning("the join request slot holds no request of this version, read as not ours: %s", error)
        return ""
    return str(request.get("nonce", "")) if isinstance(request, dict) else ""


def take_request(store: Any) -> Optional[dict[str, str]]:
    """Rank 0 after a step: a pending request, taken (so it is admitted once), or None. One `check` when idle."""
    if not store.check([REQUEST]):
        return None
    raw = store.get(REQUEST)
    if not raw or raw == TAKEN.encode():
        return None
    try:
        # Bounded: any store client can write the slot; deep nesting or non-UTF-8 bytes must be garbage to
        # free, not a RecursionError/UnicodeDecodeError that leaves the slot jammed for every later joiner.
        request = jsonbound.loads(raw, where=REQUEST, error=ProtocolError, max_bytes=MAX_REQUEST_BYTES)
        address, nonce = str(request["address"]), str(request["nonce"])
    except (ProtocolError, KeyError, TypeError) as error:
        logger.warning("malformed join request in the store (%s); freeing the slot for a real joiner",
                       str(error)[:160] or type(error).__name__)
        store.compare_set(REQUEST, raw, "")  # garbage in the slot: free it for a real joiner
        return None
    text = raw.decode()
    if store.compare_set(REQUEST, text, TAKEN).decode() != TAKEN:
        return None  # withdrawn meanwhile
    return {"address": address, "nonce": nonce}


def free_slot(store: Any) -> None:
    """After an admission (the new world formed, or it failed): the next joiner may post."""
    store.compare_set(REQUEST, TAKEN, "")
