"""Bounds on the viewer's connections, against clients that open many and never finish a
request (slowloris): uvicorn accepts every connection and waits for its request's headers
for as long as the client likes, so 20,000 half-sent requests took every file descriptor
before any token was checked, and the server answered nobody until they closed.

* A connection has ``header_timeout_s`` to send a whole request head, from when it opens and
  again from each response's end (a kept-alive connection that then trickles its next
  request's headers gets no more time); then it is closed.
* At most ``max_connections`` are open: a new one beyond it closes the connection that has
  waited longest for a request (half-sent heads first to go), so a client that sends its
  request at once is answered however many are held open; only when every open connection
  is in the middle of a request is the new one closed.

Both live in the HTTP protocol uvicorn runs for each connection (its h11 protocol, with a
timer per connection).
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 256  # browsers open 6 per host: many users' worth
HEADER_TIMEOUT_S = 20.0  # Apache's RequestReadTimeout waits 20-40 s for a request head


@dataclass(frozen=True)
class ConnectionLimits:
    """``max_connections`` open at once (None: `MAX_CONNECTIONS`, or a quarter of this
    process's file-descriptor limit when that is lower) and ``header_timeout_s`` for a
    request's head."""

    max_connections: int | None = None
    header_timeout_s: float = HEADER_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")

    @property
    def connections(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return MAX_CONNECTIONS
        return max(8, min(MAX_CONNECTIONS, soft // 4))  # slides and the rest need theirs


def bounded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with ``limits`` (for ``uvicorn.Config(http=...)``)."""
    most = limits.connections

    class Bounded(H11Protocol):
        waiting_since: float | None  # when it began waiting for a request head; None: busy
        timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.waiting_since = time.monotonic()
            self._arm(limits.header_timeout_s)
            if len(self.connections) > most:
                _make_room(self.connections, self)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.timer is not None:
                self.timer.cancel()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.busy:
                self.waiting_since = None

        def on_response_complete(self) -> None:
            self.waiting_since = time.monotonic()
            super().on_response_complete()

        @property
        def busy(self) -> bool:
            """In a request: its head read, its response not yet sent."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self, delay: float) -> None:
            self.timer = self.loop.call_later(delay, self._check)

        def _check(self) -> None:
            self.timer = None
            if self.transport.is_closing():
                return
            if self.busy or self.waiting_since is None:
                self._arm(limits.header_timeout_s)
                return
            left = self.waiting_since + limits.header_timeout_s - time.monotonic()
            if left > 0:
                self._arm(left)
            else:
                self.transport.close()  # no request head in time

    Bounded.__name__ = Bounded.__qualname__ = "BoundedH11Protocol"
    return Bounded


def _make_room(connections: set[Any], new: Any) -> None:
    """Close the open connection that has waited longest for a request, or ``new`` when
    every other one is in the middle of one."""
    waiting = [
        c
        for c in connections
        if c is not new and not c.busy and not c.transport.is_closing()
        and c.waiting_since is not None
    ]  # fmt: skip
    victim = min(waiting, key=lambda c: c.waiting_since) if waiting else new
    victim.transport.close()
    connections.discard(victim)  # counted out now: its connection_lost comes later
