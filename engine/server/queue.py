"""Admission: one request runs at a time (Strata's loan needs the whole engine); up to
`queue_max` wait in arrival order; past that a request is refused at once with a hint of when
to retry. Lives on the server's event loop (no locks: every call is from that thread).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

RETRY_AFTER_MAX_S = 60


class QueueFull(Exception):
    """Every queue place is taken; `retry_after_s` estimates when one frees."""

    def __init__(self, retry_after_s: int, queue_max: int):
        super().__init__(f"the server is busy: 1 request running and {queue_max} waiting; "
                         f"retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class Closed(Exception):
    """The server is shutting down: no request is admitted or started."""


class Ticket:
    """One admitted request's place: waiting, then running, then gone."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.started_s: float | None = None
        self.left = False

    async def turn(self) -> None:
        """Wait until this request may run (raises Closed when the server stops first)."""
        await asyncio.shield(self._turn)

    def leave(self) -> None:
        """Give the place up (the request ended, or its client left while it waited): the
        next waiting request runs. Idempotent."""
        if not self.left:
            self.left = True
            self._admission._leave(self)


class Admission:
    """The running request and the bounded queue behind it."""

    def __init__(self, queue_max: int):
        self.queue_max = queue_max
        self.running: Ticket | None = None
        self.waiting: deque[Ticket] = deque()
        self.closed = False
        self.n_refused = 0
        self._seconds: deque[float] = deque(maxlen=16)  # how long recent requests ran

    def enter(self) -> Ticket:
        """A place for a new request, running at once when the engine is free; QueueFull when
        every place is taken, Closed while shutting down."""
        if self.closed:
            raise Closed()
        if self.running is not None and len(self.waiting) >= self.queue_max:
            self.n_refused += 1
            raise QueueFull(self.retry_after_s(), self.queue_max)
        ticket = Ticket(self)
        if self.running is None:
            self._start(ticket)
        else:
            self.waiting.append(ticket)
        return ticket

    def retry_after_s(self) -> int:
        """Seconds until a queue place is likely free: the queue ahead at the recent pace."""
        per = sorted(self._seconds)[len(self._seconds) // 2] if self._seconds else 1.0
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(per * (len(self.waiting) + 1))))

    def close(self) -> None:
        """Admit nothing more; every waiting request's `turn()` raises Closed."""
        self.closed = True
        while self.waiting:
            t = self.waiting.popleft()
            t.left = True
            if not t._turn.done():
                t._turn.set_exception(Closed())

    def _start(self, ticket: Ticket) -> None:
        self.running = ticket
        ticket.started_s = time.monotonic()
        ticket._turn.set_result(None)

    def _leave(self, ticket: Ticket) -> None:
        if ticket is self.running:
            assert ticket.started_s is not None
            self._seconds.append(time.monotonic() - ticket.started_s)
            self.running = None
            if self.waiting and not self.closed:
                self._start(self.waiting.popleft())
        elif ticket in self.waiting:
            self.waiting.remove(ticket)
