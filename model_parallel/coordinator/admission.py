"""Who may hold a coordinator connection: idle or hostile clients can neither lock out ctl nor a rejoining worker.

A connection is *unauthenticated* from accept until its first frame passes the MAC check (the
`register`), then *authenticated*. The two are counted apart:

    pool              limit                          when full
    unauthenticated   MAX_UNAUTHENTICATED (64),       a newcomer displaces the oldest unauthenticated
                      MAX_PER_ADDRESS (16) per IP     connection (of its own address first)
    authenticated     MAX_AUTHENTICATED (64)          the newly authenticated one is refused

so unauthenticated connections never use an authenticated slot (those are reserved for workers and
ctl), and holding connections open gains nothing: each must finish its handshake within
HANDSHAKE_DEADLINE_S of being accepted or is closed, and a newcomer from the same address pushes
out the oldest. A real client finishes its handshake in one round trip (milliseconds), so it is
only displaced by a flood of more than MAX_PER_ADDRESS connections from its own address within
that round trip.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

MAX_UNAUTHENTICATED = 64
MAX_PER_ADDRESS = 16  # so 16 workers of one host that start together all finish their handshakes
MAX_AUTHENTICATED = 64
HANDSHAKE_DEADLINE_S = 3.0


@dataclass(eq=False)
class Ticket:
    """One accepted connection's place in the accounting."""

    conn: socket.socket
    address: str  # the peer's IP (the port changes with every connection)
    accepted: float
    authenticated: bool = False
    closed_by_us: str = ""  # why the coordinator closed it (evicted, deadline), "" otherwise
    released: bool = field(default=False, repr=False)


class Admission:
    """Thread-safe connection accounting; `admit` from the accept loop, the rest from connection threads."""

    def __init__(self, max_unauthenticated: int = MAX_UNAUTHENTICATED, max_per_address: int = MAX_PER_ADDRESS,
                 max_authenticated: int = MAX_AUTHENTICATED, handshake_deadline: float = HANDSHAKE_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_unauthenticated, self.max_per_address = max_unauthenticated, max_per_address
        self.max_authenticated, self.handshake_deadline, self.clock = max_authenticated, handshake_deadline, clock
        self._lock = threading.Lock()
        self._waiting: "OrderedDict[Ticket, None]" = OrderedDict()  # unauthenticated, oldest first
        self._authenticated = 0

    def admit(self, conn: socket.socket, address: str) -> tuple[Ticket, list[Ticket]]:
        """A ticket for a new connection, and the unauthenticated connections it displaced (already closed)."""
        ticket = Ticket(conn, address, self.clock())
        evicted = []
        with self._lock:
            same = [t for t in self._waiting if t.address == address]
            if len(same) >= self.max_per_address:
                evicted.append(same[0])
            elif len(self._waiting) >= self.max_unauthenticated:
                evicted.append(next(iter(self._waiting)))
            for old in evicted:
                old.closed_by_us = (f"displaced by a newer connection from {address} (at most {self.max_per_address} per address "
                                    f"and {self.max_unauthenticated} in all may wait for their handshake)")
                del self._waiting[old]
            self._waiting[ticket] = None
        for old in evicted:
            _close(old.conn)
        return ticket, evicted

    def expire(self) -> list[Ticket]:
        """Close the unauthenticated connections older than the handshake deadline; returns them."""
        now = self.clock()
        with self._lock:
            late = [t for t in self._waiting if now - t.accepted > self.handshake_deadline]
            for ticket in late:
                ticket.closed_by_us = f"no authenticated register within {self.handshake_deadline:.0f} s of connecting"
                del self._waiting[ticket]
        for ticket in late:
            _close(ticket.conn)
        return late

    def authenticate(self, ticket: Ticket) -> bool:
        """Move a connection whose first frame passed the MAC check to the authenticated pool (False: full)."""
        with self._lock:
            if ticket.closed_by_us or ticket.released:
                return False
            self._waiting.pop(ticket, None)
            if self._authenticated >= self.max_authenticated:
                return False
            ticket.authenticated = True
            self._authenticated += 1
            return True

    def release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._waiting.pop(ticket, None)
            if ticket.authenticated:
                self._authenticated -= 1

    def counts(self) -> tuple[int, int]:
        """(unauthenticated, authenticated) connections held now."""
        with self._lock:
            return len(self._waiting), self._authenticated


def _close(conn: socket.socket) -> None:
    # shutdown wakes the connection's thread out of recv at once; close alone would not.
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
