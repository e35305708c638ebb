"""EventFeed: the engine's bus fanned out to `GET /v1/events` clients, and the latest of each
snapshot event (what a new client is shown first, and what `GET /v1/vram` reads: the engine's
own state is only read on the engine thread).

A publish only appends to each subscriber's deque (no wakeup of the server's event loop, which
would cost the engine thread the GIL once an event); each stream takes what came at its own
pace.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from engine.trace.events import CacheChanged, Event, EventBus, GpuStats, LedgerChanged, Ready

SNAPSHOTS = (Ready, LedgerChanged, CacheChanged, GpuStats)  # a new client gets these first
QUEUE_EVENTS = 8192  # a client further behind than this is let go


class Subscriber:
    """One client's events; `ended` when the server stops or the client fell too far behind
    (then nothing more is added)."""

    def __init__(self, wants: Callable[[Event], bool]):
        self.wants = wants
        self.ended = False
        self._items: deque[Event] = deque()

    def put(self, e: Event) -> None:  # any thread
        if self.ended:
            return
        if len(self._items) >= QUEUE_EVENTS:
            self.ended = True
        else:
            self._items.append(e)

    def take(self) -> list[Event]:
        """Every event put since the last take."""
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out


class EventFeed:
    """Subscribes to the bus once; every subscriber gets the events it wants."""

    def __init__(self, bus: EventBus):
        self._lock = threading.Lock()
        self._latest: dict[type[Event], Event] = {}
        self._subs: list[Subscriber] = []
        self._closed = False
        bus.subscribe(self._on_event)

    def latest(self, cls: type[Event]) -> Event | None:
        with self._lock:
            return self._latest.get(cls)

    def subscribe(self, wants: Callable[[Event], bool]) -> Subscriber:
        """A subscriber whose events start with the latest snapshots."""
        sub = Subscriber(wants)
        with self._lock:
            for e in sorted(self._latest.values(), key=lambda e: e.t):
                if wants(e):
                    sub.put(e)
            if self._closed:
                sub.ended = True
            else:
                self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close(self) -> None:
        """End every stream (the server is stopping)."""
        with self._lock:
            self._closed = True
            subs, self._subs = self._subs, []
        for sub in subs:
            sub.ended = True

    def _on_event(self, e: Event) -> None:  # any thread (the engine's, mostly)
        with self._lock:
            if isinstance(e, SNAPSHOTS):
                self._latest[type(e)] = e
            subs = [s for s in self._subs if s.wants(e)]
        for sub in subs:
            sub.put(e)
