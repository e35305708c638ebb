"""EngineLink: the app's only door to the engine, in this process (`LocalLink`) or behind
`strata serve` (`app.remote_link.RemoteLink`).

Engine events only go into a queue (the in-process engine's bus callback runs on the engine
thread). A timer on the UI thread drains the queue at a steady rate, coalesces snapshot events
and posts one `EngineLink.Events` message per tick, so a prefill publishing thousands of events
never makes a frame wait.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from textual.app import App
from textual.message import Message

from app.draft import Draft
from engine.config import EngineOptions, LoanFlags
from engine.conversation import Conversation
from engine.errors import StrataError
from engine.events import (
    CacheChanged,
    Event,
    EventBus,
    GpuStats,
    LedgerChanged,
    PrefillProgress,
    Token,
)
from engine.forecast import LoanVerdict
from engine.sampler import SamplingParams
from engine.serve import Reply, ServeLoop

REFRESH_HZ = 15
# events that are whole snapshots: within one tick only the newest matters
_SNAPSHOTS = (LedgerChanged, CacheChanged, PrefillProgress, GpuStats)


def coalesce(events: Iterable[Event]) -> tuple[Event, ...]:
    """Keep the order; drop snapshots superseded later in the batch; merge adjacent tokens."""
    events = list(events)
    last_of: dict[type, int] = {}
    for i, e in enumerate(events):
        if isinstance(e, _SNAPSHOTS):
            last_of[type(e)] = i
    out: list[Event] = []
    for i, e in enumerate(events):
        if isinstance(e, _SNAPSHOTS) and last_of[type(e)] != i:
            continue
        if isinstance(e, Token) and out and isinstance(out[-1], Token):
            out[-1] = Token(out[-1].text + e.text, t=e.t)
            continue
        out.append(e)
    return tuple(out)


class EngineHandle(Protocol):
    """What the app reads of a loaded engine: the flags and options in force, and whether a
    request is running (the in-process ServeLoop, or the remote link's view of a server)."""

    @property
    def flags(self) -> LoanFlags: ...

    @property
    def options(self) -> EngineOptions: ...

    @property
    def busy(self) -> bool: ...


class EngineLink:
    """The app's door to an engine: its messages, and the event queue drained on the UI
    thread. `LocalLink` runs the engine in this process; `app.remote_link.RemoteLink` talks to
    `strata serve`. The app uses only what is defined here."""

    @dataclass
    class Events(Message, bubble=False):
        """A coalesced batch of engine events (one per refresh tick)."""

        events: tuple[Event, ...]

    @dataclass
    class Loaded(Message):
        loop: EngineHandle

    @dataclass
    class LoadFailed(Message):
        error: str

    @dataclass
    class ReplyDone(Message):
        conversation: Conversation
        prompt: str
        reply: Reply
        draft: Draft

    @dataclass
    class ReplyFailed(Message):
        conversation: Conversation
        error: str
        draft: Draft

    def __init__(self, app: App) -> None:
        self.app = app
        self.loop: EngineHandle | None = None
        self._queue: deque[Event] = deque()

    # -- UI thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the drain timer, then connect to (or load) the engine."""
        self.app.set_interval(1 / REFRESH_HZ, self.drain, name="engine-drain")
        self._begin()

    def take(self) -> tuple[Event, ...]:
        """Everything published since the last take, coalesced."""
        batch = []
        while self._queue:
            batch.append(self._queue.popleft())
        return coalesce(batch)

    def drain(self) -> None:
        """Post what the engine published since the last tick (no-op when nothing did)."""
        batch = self.take()
        if batch:
            self.app.post_message(self.Events(batch))

    @property
    def busy(self) -> bool:
        return self.loop is not None and self.loop.busy

    def _begin(self) -> None:
        raise NotImplementedError

    def send(
        self,
        conv: Conversation,
        prompt: str,
        draft: Draft,
        params: SamplingParams,
        max_new: int,
    ) -> None:
        """Answer `prompt` in `conv`; ReplyDone or ReplyFailed follows."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Cancel the running request (it rolls back)."""
        raise NotImplementedError

    def set_flags(self, flags: LoanFlags, options: EngineOptions) -> list[str]:
        """Ask for new flags/options; the guards' violations (empty: accepted)."""
        raise NotImplementedError

    def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` (None while no engine answers); from a worker thread."""
        raise NotImplementedError

    def preview(self, conv: Conversation, text: str) -> LoanVerdict | None:
        """What sending `text` in `conv` would get: the loan or why not, and the forecast
        (None while no engine answers); from a worker thread."""
        raise NotImplementedError

    def what_if(self, flags: LoanFlags, options: EngineOptions, n_fresh: int) -> LoanVerdict:
        """The verdict on an `n_fresh`-token message under flags not applied yet; FlagError
        when the guards would refuse them, StrataError when no engine answers; from a worker
        thread."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class LocalLink(EngineLink):
    """The engine in this process: a ServeLoop in thread workers, its bus feeding the queue."""

    def __init__(self, app: App, options: EngineOptions, flags: LoanFlags):
        super().__init__(app)
        self.options, self.flags = options, flags
        self.bus = EventBus()
        self.loop: ServeLoop | None = None
        self._unsubscribe: Callable[[], None] = self.bus.subscribe(self._queue.append)

    def _begin(self) -> None:
        self.app.run_worker(self._load, thread=True, group="engine", name="load")

    def send(
        self,
        conv: Conversation,
        prompt: str,
        draft: Draft,
        params: SamplingParams,
        max_new: int,
    ) -> None:
        assert self.loop is not None, "send before the engine is loaded"
        loop = self.loop

        def work() -> None:
            try:
                reply = loop.chat(conv, prompt, params, max_new)
            except StrataError as exc:
                self.app.post_message(self.ReplyFailed(conv, str(exc), draft))
            else:
                self.app.post_message(self.ReplyDone(conv, prompt, reply, draft))

        self.app.run_worker(work, thread=True, group="engine", name="chat")

    def cancel(self) -> None:
        if self.loop is not None:
            self.loop.cancel()

    def set_flags(self, flags: LoanFlags, options: EngineOptions) -> list[str]:
        assert self.loop is not None
        return self.loop.set_flags(flags, options)

    def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` (None while the engine loads); call it from a worker thread."""
        return self.loop.count_tokens(text) if self.loop is not None else None

    def preview(self, conv: Conversation, text: str) -> LoanVerdict | None:
        """What sending `text` in `conv` would get: the loan or why not, and the forecast
        (None while the engine loads). It tokenizes the conversation: call it from a worker
        thread."""
        return self.loop.preview(conv, text) if self.loop is not None else None

    def what_if(self, flags: LoanFlags, options: EngineOptions, n_fresh: int) -> LoanVerdict:
        """The verdict on an `n_fresh`-token message under flags not applied yet; FlagError
        when the guards would refuse them."""
        assert self.loop is not None, "what_if before the engine is loaded"
        return self.loop.what_if(flags, options, n_fresh)

    def close(self) -> None:
        """Stop listening to the engine, cancel a running request, unfreeze the heap."""
        self._unsubscribe()
        self.cancel()
        gc.unfreeze()

    # -- worker thread -----------------------------------------------------------------------
    def _load(self) -> None:
        try:
            loop = ServeLoop.create(self.options, self.flags, self.bus)
        except (StrataError, OSError) as exc:
            self.app.post_message(self.LoadFailed(str(exc)))
            return
        self.loop = loop
        # The model, the engine and the widgets built so far live as long as the app: frozen,
        # a full collection scans only what comes after (it scanned ~140k objects, ~65 ms
        # with both threads stopped, every few hundred generated tokens).
        gc.collect()
        gc.freeze()
        self.app.post_message(self.Loaded(loop))
