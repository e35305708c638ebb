"""EngineLink: the app's only door to the engine, in this process (`LocalLink`) or behind
`strata serve` (`app.remote_link.RemoteLink`).

Engine events only go into a queue (the in-process engine's bus callback runs on the engine
thread and does nothing else: one deque append a token). A timer on the UI thread drains the
queue at a steady rate, coalesces snapshot events and posts one `EngineLink.Events` message per
tick, so a prefill publishing thousands of events never makes a frame wait, and the UI thread's
cost while decoding is a cost per frame, not per token.

While an answer streams (its first token to its RequestDone) its text goes out in frames, the
first once the first token is a frame old, and the other events (the dashboard's: a lend's
ledger and cache snapshots, trace lines) at most every VIEWS_WHILE_STREAMING_S: a frame costs
the UI thread milliseconds and a dashboard update, which reflows the whole screen, tens, time
the engine thread waits for under the GIL; an answer decoded in less than a frame (a short one
on a GPU) is drawn once, when it is done. A frame goes only while the UI thread's CPU time since
the answer's first token is within UI_BUDGET of the time since: however fast the engine, the
UI thread takes at most that share from it.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from textual.app import App
from textual.message import Message

from app.draft import Draft
from engine.config import EngineOptions, LoanFlags
from engine.errors import StrataError
from engine.loan.forecast import LoanVerdict
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import Reply, ServeLoop
from engine.trace.events import (
    CacheChanged,
    Event,
    EventBus,
    GpuStats,
    LedgerChanged,
    PrefillProgress,
    RequestDone,
    Token,
)

REFRESH_HZ = 10  # frames a second: each costs the UI thread 2-6 ms under the GIL at 120x40
VIEWS_WHILE_STREAMING_S = 2.0  # nvitop redraws every 2 s by default
# While an answer streams, the UI thread's CPU time since its first token stays under this share
# of the time since (plus UI_BURST_S): past it, the next frame waits. A frame costs the same
# whether the engine makes 60 tokens a second or 1,000, so on a fast GPU the text comes in
# fewer, larger pieces, and the engine thread seldom waits for the GIL.
UI_BUDGET = 0.03
UI_BURST_S = 0.01
# ... but the text never waits longer than this: the budget counts all the UI thread's work
# (a user scrolling or typing while the answer streams), and the answer must still move
MAX_HOLD_S = 0.5
# events that are whole snapshots: within one tick only the newest matters
_SNAPSHOTS = (LedgerChanged, CacheChanged, PrefillProgress, GpuStats)


def coalesce(events: Iterable[Event]) -> tuple[Event, ...]:
    """Keep the order; drop snapshots superseded later in the batch; merge adjacent tokens
    (joined once: a batch held for seconds can hold thousands)."""
    events = list(events)
    last_of: dict[type, int] = {}
    for i, e in enumerate(events):
        if isinstance(e, _SNAPSHOTS):
            last_of[type(e)] = i
    out: list[Event] = []
    run: list[Token] = []  # adjacent tokens not merged yet
    for i, e in enumerate(events):
        if isinstance(e, Token):
            run.append(e)
            continue
        if run:
            out.append(_merged(run))
            run = []
        if not (isinstance(e, _SNAPSHOTS) and last_of[type(e)] != i):
            out.append(e)
    if run:
        out.append(_merged(run))
    return tuple(out)


def _merged(tokens: list[Token]) -> Token:
    return tokens[0] if len(tokens) == 1 else Token("".join(t.text for t in tokens),
                                                    t=tokens[-1].t)


class Drain:
    """What goes out on each tick: every event, except while an answer streams (its first
    token to its RequestDone). Then the text goes in frames: the first once the first token
    is `frame_s` old (a frame's worth of text, and an answer that takes less than a frame to
    decode draws once, when it is done), then every tick while the UI thread's CPU time since
    the first token is within `budget` of the time since plus `burst_s`, and at least every
    `max_hold_s`; the other events wait until `views_s` passed since they last went, or the
    answer ends."""

    def __init__(self, frame_s: float = 1 / REFRESH_HZ,
                 views_s: float = VIEWS_WHILE_STREAMING_S,
                 budget: float = UI_BUDGET, burst_s: float = UI_BURST_S,
                 max_hold_s: float = MAX_HOLD_S) -> None:
        self.frame_s, self.views_s = frame_s, views_s
        self.budget, self.burst_s, self.max_hold_s = budget, burst_s, max_hold_s
        self._sent_at = 0.0  # when text last went out (or the first text came)
        self._began = (0.0, 0.0)  # (time, UI thread CPU time) at the first tick with text
        self.streaming = False
        self._text: list[Event] = []  # the first frame's text, until it is a frame old
        self._text_at = 0.0  # when it is
        self._held: list[Event] = []  # events other than text, held while streaming
        self._views_at = 0.0  # when held events last went out

    def tick(self, batch: list[Event], now: float, cpu: float | None = None) -> tuple[Event, ...]:
        """This tick's events, coalesced: of `batch` (what came since the last tick) and
        those held. `cpu`: the UI thread's CPU time now (None: no budget)."""
        if not self.streaming:
            first = next((e for e in batch if isinstance(e, Token)), None)
            if first is None:
                return self._out(batch, now)
            # what came with the first text waits too (a loan's snapshots, its trace lines)
            self.streaming, self._views_at = True, now
            self._text_at = first.t + self.frame_s
            self._began = (now, cpu or 0.0)
            self._sent_at = first.t
        self._text += (e for e in batch if isinstance(e, Token))
        rest = [e for e in batch if not isinstance(e, Token)]
        self._held += rest
        if any(isinstance(e, RequestDone) for e in rest):
            return self._out([], now)
        if now < self._text_at or (cpu is not None and self._over_budget(now, cpu)
                                   and now - self._sent_at < self.max_hold_s):
            return ()
        text, self._text = self._text, []
        self._sent_at = now
        if now - self._views_at >= self.views_s:
            return self._out(text, now)
        return coalesce(text)

    def _over_budget(self, now: float, cpu: float) -> bool:
        began_at, began_cpu = self._began
        return cpu - began_cpu > self.budget * (now - began_at) + self.burst_s

    def take(self, batch: list[Event]) -> tuple[Event, ...]:
        """Everything held and `batch`, coalesced; the answer (if one streamed) is over."""
        out = self._out(batch, time.monotonic())
        self.streaming = False
        return out

    def _out(self, batch: list[Event], now: float) -> tuple[Event, ...]:
        events = self._held + self._text + batch
        self._held, self._text = [], []
        if any(isinstance(e, RequestDone) for e in events):
            self.streaming = False
        self._views_at = now
        return coalesce(events)


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
        """A coalesced batch of engine events (one per refresh tick); `streaming`: an answer
        streams on after it (the views hold their height until it ends)."""

        events: tuple[Event, ...]
        streaming: bool = False

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
        self._drain = Drain()

    # -- UI thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the drain timer, then connect to (or load) the engine."""
        self.app.set_interval(1 / REFRESH_HZ, self.drain, name="engine-drain")
        self._begin()

    def take(self) -> tuple[Event, ...]:
        """Everything published and not posted yet, coalesced (a request is over: nothing
        waits for a later tick)."""
        return self._drain.take(self._popped())

    def drain(self) -> None:
        """Post this tick's events (no-op when there are none): the text of a streaming
        answer every tick, the other events while it streams only now and then."""
        batch = self._drain.tick(self._popped(), time.monotonic(), time.thread_time())
        if batch:
            self.app.post_message(self.Events(batch, self._drain.streaming))

    def _popped(self) -> list[Event]:
        queue, batch = self._queue, []
        while queue:  # popleft, not a swap: the engine thread appends meanwhile
            batch.append(queue.popleft())
        return batch

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
