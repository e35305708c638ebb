"""Gate: holds the engine thread at a chosen event, so a test acts at a known point of a
request (mid-prefill, mid-decode), however fast the machine is."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.trace.events import Event, EventBus


class Gate:
    """Holds the engine thread at the first event `when` accepts until `release()` (30 s at
    most, so a failing test does not hang): a test presses Esc (or quits, or kills a client)
    at a known point of a request, however fast the machine is."""

    def __init__(self, bus: EventBus, when: Callable[[Event], bool]):
        self.reached, self._released = threading.Event(), threading.Event()
        self._when = when
        bus.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        if not self.reached.is_set() and self._when(event):
            self.reached.set()
            self._released.wait(30)

    def release(self) -> None:
        self._released.set()
