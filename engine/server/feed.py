"""EventFeed: the engine's bus, fanned out to `GET /v1/events` clients on the server's event
loop, and the latest of each snapshot event (what a new client is shown first, and what
`GET /v1/vram` reads: the engine's own state is only read on the engine thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from engine.events import CacheChanged, Event, EventBus, GpuStats, LedgerChanged, Ready

SNAPSHOTS = (Ready, LedgerChanged, CacheChanged, GpuStats)  # a new client gets these first
QUEUE_EVENTS = 8192  # a client further behind than this is let go


class Subscriber:
    """One client's queue of events; None ends it (the server stops, or it fell behind)."""

    def __init__(self, aio: asyncio.AbstractEventLoop, wants: Callable[[Event], bool]):
        self.aio, self.wants = aio, wants
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self.overflowed = False

    def put(self, item: Event | None) -> None:
        """On the event loop: queue `item`, or end the stream of a client too far behind."""
        if self.overflowed:
            return
        if item is not None and self.queue.qsize() >= QUEUE_EVENTS:
            self.overflowed, item = True, None
        self.queue.put_nowait(item)


class EventFeed:
    """Subscribes to the bus once; delivers to every subscriber's loop thread-safely."""

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
        """A subscriber on the running loop, its queue starting with the latest snapshots."""
        sub = Subscriber(asyncio.get_running_loop(), wants)
        with self._lock:
            for e in sorted(self._latest.values(), key=lambda e: e.t):
                if wants(e):
                    sub.put(e)
            if self._closed:
                sub.put(None)
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
            _deliver(sub, None)

    def _on_event(self, e: Event) -> None:  # any thread (the engine's, mostly)
        with self._lock:
            if isinstance(e, SNAPSHOTS):
                self._latest[type(e)] = e
            subs = [s for s in self._subs if s.wants(e)]
        for sub in subs:
            _deliver(sub, e)


def _deliver(sub: Subscriber, item: Event | None) -> None:
    try:
        sub.aio.call_soon_threadsafe(sub.put, item)
    except RuntimeError:  # its loop has closed: the server is gone
        pass
