"""Re-forming the world inside the job after a rank is lost (`--recover`): who survived, where they meet again.

Generation 0 is the world every rank joined at start. At that join each rank publishes its address
(`mp/addr/<rank>`) and reads everyone's, so the meeting point of a later generation is known before
anything fails. When the engine raises a PeerError naming lost rank(s), each survivor:

1. abandons the broken communicator: closes its gloo connections to every peer (`close_connections`: a survivor
   still waiting on this one then fails at once, not after its --timeout) and `destroy_process_group()`, in a
   daemon thread with a deadline (a gloo operation blocked on a stopped peer may never return; a survivor never
   hangs on it);
2. meets the others in generation g = previous + 1. The store: the previous generation's, under the key
   prefix `mp/recovery/<g>/`, while its host lives; when the host is lost, the lowest surviving original
   rank hosts a new TCPStore at `--dist_port + g` on the address it published at the first join;
3. registers (`member/<original rank>`) and waits up to `JOIN_TIMEOUTS` x --timeout for the survivors it
   expects; the first to finish waiting closes the membership with an atomic compare-and-set, so every
   survivor reads the same list. The new world is exactly who registered in time (a second failure just
   shrinks it); a rank that registers after the close, or whose peers declared it lost, was replaced;
4. joins a process group of the new world: new rank = index of its original rank among the members;
5. when that group does not form (a member lost after it registered: it died, or stood still, before joining),
   meets again at generation g + 1 from the membership that closed, the lost one unknown: it does not register in
   time, and if it hosted the meeting store, the store is unreachable and the lowest other member hosts the next
   one (step 2). Each retry drops at least one member; a store host that stood still while its group formed knows
   the others went on without it (it is replaced, like a member that registers after the close).

Original ranks never change: logs, `mp/replaced/<original rank>` (written in the store of the world a rank
was dropped from) and the recovery records name processes by them.
"""
from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from model_parallel.errors import PeerError, ReplacedError
from model_parallel.runtime.wire.stillness import Stillness

logger = logging.getLogger(__name__)

_ADDR = "mp/addr/{}"
_REPLACED = "mp/replaced/{}"
JOIN_TIMEOUTS = 3.0  # of --timeout: a survivor diagnoses within 1.4 T (health.py) and abandons within 0.5 T more
ABANDON_SHARE = 0.5  # of --timeout: how long destroying the broken process group may take
STILL_SHARE = 0.5  # of --timeout: a process that stood still this long was given up on (the rule of wire/health.py)
_T = TypeVar("_T")
_CAUSE = re.compile(r"^(?:\[[^\]]*\]\s*)*rank (\d+) (?:stopped responding|failed)")


@dataclass(frozen=True)
class Lineage:
    """The world's history as one process knows it (original ranks throughout)."""

    me: int  # this process's original rank
    generation: int  # 0: the world joined at start
    members: tuple[int, ...]  # original ranks of the current world, sorted: current rank r is members[r]
    addresses: tuple[str, ...]  # every original rank's address, published at the first join
    base_port: int  # --dist_port: generation g's own store, when one is needed, listens at base_port + g
    store_host: int  # original rank whose process hosts the current base store
    store_port: int  # the port it listens at (base_port + the generation that created it)
    base_store: Any  # the TCPStore of the current store host (generation prefixes go on top of it)
    world_store: Any  # the store the current world's heartbeats and statuses live in

    def original(self, rank: int) -> int:
        """The original rank of current rank `rank`."""
        return self.members[rank]


def _bounded(call: Callable[[], _T], seconds: float, what: str) -> _T:
    """A store call in a daemon thread, given up after `seconds` (an unreachable host never answers)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # noqa: BLE001 - re-raised below in the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target, name="recovery-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise PeerError(f"{what}: no answer within {seconds:.1f} s")
    if "error" in box:
        raise PeerError(f"{what}: {str(box['error']).splitlines()[0][:200] if str(box['error']) else type(box['error']).__name__}")
    return box["value"]


def own_address(store_addr: str) -> str:
    """The address the others reach this host at: the local end of the route to the store's host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((store_addr, 9))  # UDP: no packet is sent, the kernel only picks the route
            return str(probe.getsockname()[0])
        except OSError:
            return store_addr


def first_lineage(rank: int, world_size: int, store: Any, store_address: str, timeout: float) -> Lineage:
    """At the first join (rank 0 hosts `store` at `store_address`): publish this rank's address and read
    everyone's (collective over the store)."""
    host, port = store_address.rsplit(":", 1)
    mine = host if rank == 0 else own_address(host)
    store.set(_ADDR.format(rank), mine)
    keys = [_ADDR.format(r) for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - the store's own timeout or its host gone
        raise PeerError(f"rank {rank}: not every rank published its address for --recover within {timeout:g} s: "
                        f"{str(error).splitlines()[0][:200]}") from None
    addresses = tuple(store.get(k).decode() for k in keys)
    return Lineage(me=rank, generation=0, members=tuple(range(world_size)), addresses=addresses, base_port=int(port),
                   store_host=0, store_port=int(port), base_store=store, world_store=store)


def lost_ranks(message: str) -> Optional[int]:
    """The current rank a PeerError's message names as the culprit (health.py's wording), or None."""
    match = _CAUSE.match(message.strip())
    return int(match.group(1)) if match else None


def was_replaced(lineage: Lineage, seconds: float) -> Optional[str]:
    """What the world this process belonged to recorded about it: the generation that dropped it, or None
    (the record is unreadable: the store host is gone, or nobody has written it yet)."""
    key = _REPLACED.format(lineage.me)
    try:
        if _bounded(lambda: lineage.world_store.check([key]), seconds, "reading the replaced record"):
            return _bounded(lambda: lineage.world_store.get(key), seconds, "reading the replaced record").decode()
    except PeerError:
        return None
    return None


_CLOSE_TAG = 987_654_321  # a tag nothing is ever sent on: a receive posted on it can only time out


def close_connections() -> None:
    """Close this rank's gloo connections to every peer in every group, so that a peer still waiting on this rank
    (a survivor not next to the lost one) fails at once instead of after its --timeout. destroy_process_group does
    not close them while a receive is pending; a receive that times out does ("Application timeout caused pair
    closure"), so one is posted per peer on an unused tag and given 1 ms."""
    import torch
    import torch.distributed as dist

    probe = torch.zeros(1)
    for group in list(dist.distributed_c10d._world.pg_map):
        try:
            if dist.get_backend(group) != "gloo":
                continue  # NCCL has its own abort; its connections are not sockets the peers wait on
            me, size = group.rank(), group.size()
        except (RuntimeError, ValueError):
            continue
        for peer in range(size):
            if peer == me:
                continue
            try:
                work = dist.irecv(probe, group=group, group_src=peer, tag=_CLOSE_TAG)
                if work is not None:  # None: not a member of `group`
                    work.wait(timedelta(milliseconds=1))
            except RuntimeError:
                pass  # the expected timeout (the pair is closed now), or a pair that broke already


def abandon(seconds: float, close_first: bool = True) -> bool:
    """Close the broken process group's connections (`close_first`: after a failure; an admission, where every
    rank leaves at the same boundary, does not) and destroy it, in a daemon thread; False when that did not finish
    within `seconds`."""
    import torch.distributed as dist

    def destroy() -> None:
        if dist.is_initialized():
            if close_first:
                close_connections()
            dist.destroy_process_group()

    done = threading.Event()

    def target() -> None:
        try:
            destroy()
        except Exception as error:  # noqa: BLE001 - a broken group may complain while it goes
            logger.debug("destroying the broken process group: %s", error)
        done.set()

    threading.Thread(target=target, name="abandon-process-group", daemon=True).start()
    return done.wait(seconds) and not dist.is_initialized()


@dataclass(frozen=True)
class Reformed:
    """The outcome of one re-forming: the new world (its process group is joined) and lineage, and who left it."""

    rank: int
    world_size: int
    store: Any  # the new world's store (heartbeats, statuses)
    store_host: Optional[int]  # the current rank hosting it (None: not a member)
    store_address: str  # host:port, for messages
    lineage: Lineage
    dropped: tuple[int, ...]  # original ranks of the previous world that are not in the new one


def _meeting_store(lineage: Lineage, lost: set[int], generation: int, timeout: float,
                   watching: Optional["Stillness"] = None) -> tuple[Any, int]:
    """(base store, its host's original rank) of `generation`: the old one while its host lives, else a new one;
    ReplacedError when it is unreachable after this process stood still (`watching`) for STILL_SHARE x timeout."""
    from torch.distributed import TCPStore

    if lineage.store_host not in lost:
        try:
            # A set alone is no proof: the client buffers it, so it "succeeds" on a host that stands still (SIGSTOP);
            # the check needs the host's answer.
            alive = f"mp/recovery/{generation}/alive/{lineage.me}"
            _bounded(lambda: (lineage.base_store.set(alive, "1"), lineage.base_store.check([alive])),
                     max(1.0, timeout / 4), f"the store hosted by rank {lineage.store_host}")
            return lineage.base_store, lineage.store_host
        except PeerError as error:
            still = watching.now() if watching is not None else 0.0
            if still >= STILL_SHARE * timeout:
                # Its peers went on without it and ended (or met elsewhere): it formed a world of its own (exit 0)
                raise ReplacedError(f"original rank {lineage.me} was replaced: it stood still for {still:.1f} s while "
                                    f"it recovered and then found the store of generation {lineage.generation} "
                                    f"unreachable ({error}): its peers re-formed the world without it (or finished)")
            logger.warning("rank %d: the store of generation %d is unreachable (%s): its host, original rank %d, "
                           "counts as lost", lineage.me, lineage.generation, error, lineage.store_host)
            lost = lost | {lineage.store_host}
    survivors = [m for m in lineage.members if m not in lost]
    if not survivors:
        raise PeerError(f"rank {lineage.me}: every rank of generation {lineage.generation} is lost")
    host = survivors[0]  # the rule every survivor applies alike: the lowest surviving original rank hosts
    addr, port = lineage.addresses[host], lineage.base_port + generation
    try:
        store = TCPStore(addr, port, None, is_master=lineage.me == host, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)
    except (RuntimeError, OSError) as error:
        raise PeerError(f"rank {lineage.me}: cannot reach the recovery store of generation {generation} at {addr}:{port} "
                        f"(hosted by original rank {host}, the lowest survivor) within {timeout:g} s: "
                        f"{str(error).splitlines()[0][:200]}") from None
    return store, host


def _close_membership(store: Any, lineage: Lineage, expected: list[int], wait_s: float) -> list[int]:
    """Register, wait for `expected` (or the deadline), and read the membership the first closer wrote."""
    call = max(1.0, wait_s / 4)
    _bounded(lambda: store.set(f"member/{lineage.me}", "1"), call, "registering for recovery")
    deadline = time.monotonic() + wait_s
    registered: list[int] = []
    while True:
        registered = _bounded(lambda: [m for m in lineage.members if store.check([f"member/{m}"])], call,
                              "reading the registrations")
        if set(expected) <= set(registered) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    view = json.dumps(sorted(registered))
    closed = _bounded(lambda: store.compare_set("members", "", view), call, "closing the membership")
    _bounded(lambda: store.set(f"seen/{lineage.me}", "1"), call, "noting the membership read")  # for _all_seen
    return [int(m) for m in json.loads(closed.decode())]


def _all_seen(store: Any, members: list[int], seconds: float) -> None:
    """Wait (up to `seconds`; giving up is harmless) until every member read the closed membership: where a test hook
    signals this process, so that the others know the membership when it goes. (A member that never read it, its
    store's host lost first, cannot tell who met: it ends with the PeerError of `_close_membership`.)"""
    try:
        _bounded(lambda: store.wait([f"seen/{m}" for m in members], timedelta(seconds=seconds)), seconds + 1.0,
                 "waiting for every member to read the membership")
    except PeerError as error:
        logger.warning("original rank(s) %s: %s", members, error)


def reform(lineage: Lineage, lost: set[int], timeout: float, backend: str,
           on_closed: Optional[Callable[[int], None]] = None, watching: Optional[Stillness] = None) -> Reformed:
    """Meet the survivors in the next generation and join its process group (see the module docstring).

    `lost`: original ranks this process knows are gone. `on_closed(generation)`: called once the membership of a
    generation closed with this process in it and every member read it, before its process group forms (the test
    hook `reform`; None: no wait). `watching`: this process's stand-still since it detected the failure.

    A member lost after the membership closed (it registered, then died or stood still) leaves the others' process
    group unformed. Each member whose group did not form meets again one generation later, from the membership that
    closed (who is lost is unknown there: the lost one does not register in time; if it hosted the meeting store,
    `_meeting_store` finds it unreachable and the lowest other member hosts the next one). A retry must drop someone:
    at most len(members) - 1 of them. A member whose group did form (the lost one died inside the rendezvous) is in
    a world that lacks a rank: its first collective fails, and it recovers from that world into the same next
    generation (the same store rule); a failure before that, while agreeing on the source, still ends it.

    Raises ReplacedError when a membership closed without this process (or it hosted the meeting store and stood
    still while the group formed: the others went on at a store of their own), PeerError when the survivors cannot
    meet. `Reformed.dropped` is relative to `lineage` (every generation this call went through)."""
    from torch.distributed import PrefixStore

    current, known_lost = lineage, set(lost)
    watching = watching or Stillness().start()  # a joiner's and an admission's meeting are watched from here
    while True:
        generation = current.generation + 1
        base, host = _meeting_store(current, known_lost, generation, timeout, watching)
        store = PrefixStore(f"mp/recovery/{generation}", base)
        expected = [m for m in current.members
                    if m not in known_lost and (m != current.store_host or host == current.store_host)]
        members = _close_membership(store, current, expected, JOIN_TIMEOUTS * timeout)
        if lineage.me not in members:
            raise ReplacedError(f"original rank {lineage.me} was replaced: the survivors re-formed the world as "
                                f"generation {generation} with original ranks {members} before it registered")
        _record_replaced(current, [m for m in current.members if m not in members], generation)
        port = current.store_port if base is current.base_store else current.base_port + generation
        formed = replace(current, generation=generation, members=tuple(members), store_host=host, store_port=port,
                         base_store=base, world_store=store)
        stillness = Stillness().start()
        try:
            if on_closed is not None:
                _all_seen(store, members, timeout)
                on_closed(generation)
            _join_group(formed, backend, timeout)
            _check_still(formed, host, stillness.stop(), timeout, None)
            break
        except PeerError as error:
            _check_still(formed, host, stillness.stop(), timeout, error)
            if current is not lineage and len(members) == len(current.members):
                raise PeerError(f"{error}; meeting again dropped nobody, so no lost member explains it") from None
            if len(members) == 1:
                raise  # a world of one has no peer to wait for: what failed is not a lost member
            logger.warning("%s; meeting again as generation %d from the members that closed generation %d",
                           error, generation + 1, generation)
            current, known_lost = formed, set()
        finally:
            stillness.stop()
    watching.stop()
    logger.info("original rank %d: generation %d formed (original ranks %s), rank %d of %d", lineage.me, generation,
                members, members.index(lineage.me), len(members))
    dropped = tuple(m for m in lineage.members if m not in members)
    return Reformed(members.index(lineage.me), len(members), store, members.index(host) if host in members else None,
                    f"{lineage.addresses[host]}:{port}", formed, dropped)


def _check_still(formed: Lineage, host: int, still: float, timeout: float, error: Optional[PeerError]) -> None:
    """ReplacedError when this process hosts the meeting store of `formed` and stood still for STILL_SHARE x timeout
    or more while its process group formed (`error`: why it did not): the others may have found the store
    unreachable and met at one of their own, and re-forming here would make a second world of whoever is left on
    this store (this process alone). A group that did form goes (its peers then fail at once and recover without
    this process)."""
    if host != formed.me or still < STILL_SHARE * timeout:
        return
    if error is None:
        abandon(ABANDON_SHARE * timeout)
    why = f" ({error})" if error is not None else ""
    raise ReplacedError(f"original rank {formed.me} was replaced: it hosts the store of generation {formed.generation} "
                        f"and stood still for {still:.1f} s while its process group formed{why}; the others re-form "
                        f"without it")


def _record_replaced(world: Lineage, dropped: list[int], generation: int) -> None:
    """What a dropped process reads if it comes back (SIGCONT), in the store of the world it was dropped from: it must
    not rejoin silently."""
    try:
        _bounded(lambda: [world.world_store.set(_REPLACED.format(m), str(generation)) for m in dropped], 1.0,
                 "recording the replaced")
    except PeerError:
        pass  # the old world's store host is gone: so is anyone who could read it there


def _join_group(formed: Lineage, backend: str, timeout: float) -> None:
    """Join the process group of `formed` (new rank = index of this process's original rank among the members)."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore

    rank, size = formed.members.index(formed.me), len(formed.members)
    what = (f"rank {formed.me}: the process group of generation {formed.generation} (original ranks "
            f"{list(formed.members)}) did not form (--timeout {timeout:g} s)")
    # In a daemon thread, given up after (1 + ABANDON_SHARE) x timeout: the rendezvous' store calls wait on no
    # timeout when the store's host stands still (SIGSTOP) instead of dying.
    try:
        _bounded(lambda: dist.init_process_group(backend, store=PrefixStore("pg", formed.world_store), rank=rank,
                                                 world_size=size, timeout=timedelta(seconds=timeout)),
                 (1 + ABANDON_SHARE) * timeout, what)
    except PeerError as error:
        if dist.is_initialized():  # half-made: the next generation's init must find none
            abandon(ABANDON_SHARE * timeout, close_first=False)
        raise error from None
