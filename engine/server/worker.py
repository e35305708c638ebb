"""EngineWorker: the engine thread. It runs one admitted request at a time through the serve
loop (the same `ServeLoop.chat` as `strata run`, so the text is the same), hands its text to
the server's event loop as it comes, and checks the engine after every request.

Every API request is one conversation to the serve loop: its KV keeps the prefix a request
shares with the one before (`usage.prompt_tokens_details.cached_tokens`). A cancelled or
failed request is rolled back by the serve loop; the worker then checks that the ledger is as
it was when the request started, and refuses further work (with the reason) if it is not.

The prompt is rendered and tokenized here, once the request has its turn: a costly prompt
waits in the queue (or is refused 429) like any other, and never holds the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.errors import StrataError
from engine.request.conversation import Conversation
from engine.runtime.serve import Reply, ServeLoop
from engine.server.schema import ChatRequest, RequestError
from engine.trace.events import Event, PrefillProgress, RequestStarted
from engine.trace.timing import Timing

API_CONVERSATION = "api"
LOG_NAME = "strata.server"  # the server's own log (uvicorn's is `uvicorn.error`)
Item = str | PrefillProgress  # text, or prefill progress
log = logging.getLogger(LOG_NAME)


def conversation(request: ChatRequest, with_prompt: bool = False) -> Conversation:
    """The request's messages before the user's last one (all of them with `with_prompt`)."""
    conv = Conversation(id=API_CONVERSATION)
    for role, text in request.messages if with_prompt else request.history:
        conv.add(role, text)
    return conv


class Job:
    """One request on its way through the engine thread: `accepted` once its prompt is
    tokenized and fits (`fit(n_prompt_tokens)` gives the tokens to generate, or raises the
    RequestError that refuses it), its items as they come (`take`), then `finished` with the
    reply or the error (`accepted` is set then too).

    The engine thread only appends items; the server's event loop takes them at its own pace
    (a stream flushes `sse.FLUSH_HZ` times a second): waking the loop for every token would
    cost the engine thread the GIL (and, on a busy machine, a core) once a token."""

    def __init__(self, request: ChatRequest, fit: Callable[[int], int],
                 on_done: Callable[[], None]):
        self.request, self.fit = request, fit
        self.max_new = 0  # set by `fit` on the engine thread
        self.aio = asyncio.get_running_loop()
        self.cancel_event = threading.Event()
        self._items: deque[Item] = deque()  # appended on the engine thread, taken on the loop
        self.accepted = asyncio.Event()
        self.finished = asyncio.Event()
        self.reply: Reply | None = None
        self.error: BaseException | None = None
        self.refused = False  # the error came before generation: the request's own fault
        self._on_done = on_done

    def cancel(self) -> None:
        """Stop the request (any thread): it rolls back at its next chunk or token."""
        self.cancel_event.set()

    def put(self, item: Item) -> None:  # engine thread
        self._items.append(item)

    def take(self) -> list[Item]:
        """Every item put since the last take (on the event loop)."""
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

    def accept(self) -> None:  # engine thread
        """The prompt fits: the answer may start (`accepted` is set on the event loop)."""
        self._on_loop(self.accepted.set)

    def finish(self, reply: Reply | None, error: BaseException | None) -> None:  # engine thread
        """The reply (or the error), after every item: `finished` is set on the event loop."""

        def done() -> None:
            self.reply, self.error = reply, error
            self.finished.set()
            self.accepted.set()
            self._on_done()

        self._on_loop(done)

    def _on_loop(self, call: Callable[[], None]) -> None:
        try:
            self.aio.call_soon_threadsafe(call)
        except RuntimeError:  # the event loop has closed: nobody waits for this any more
            pass


class EngineWorker:
    """The one thread that runs requests on the engine."""

    def __init__(self, loop: ServeLoop, on_line: Callable[[str], None] | None = None,
                 on_outcome: Callable[[str], None] | None = None):
        self.loop = loop
        self.on_line = on_line or (lambda line: None)
        self.on_outcome = on_outcome or (lambda outcome: None)
        self.current: Job | None = None
        self.fault: str | None = None  # why the engine may not run another request
        self.outcomes: dict[str, int] = {"completed": 0, "cancelled": 0, "failed": 0}
        self._before: tuple[object, ...] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-engine")
        loop.bus.subscribe(self._on_event)

    def start(self, job: Job) -> None:
        """Run `job` on the engine thread (admission makes sure none is running)."""
        self._pool.submit(self._run, job)

    def prompt_tokens(self, request: ChatRequest) -> int:
        """The request's prompt length in tokens (any thread: the tokenizer locks itself); a
        chat template that cannot render the messages is a RequestError naming them."""
        try:
            return len(self.loop.prompt_ids(conversation(request, with_prompt=True)))
        except StrataError as exc:
            raise RequestError(f"messages: {exc}", "messages") from None

    def close(self) -> None:
        """Cancel the running request and wait until the engine thread is idle."""
        job = self.current
        if job is not None:
            job.cancel()
        self._pool.shutdown(wait=True)

    def idle_state(self) -> tuple[object, ...]:
        """What must be as before a request once it is rolled back: the ledger's regions
        (bytes and segments) and the cache's slots, none lent. Engine thread (or idle)."""
        rt = self.loop.rt
        regions = tuple((r.name, r.used_bytes, r.n_segments) for r in rt.ledger.snapshot().regions)
        cache = (rt.cache.n_slots, rt.cache.n_lent) if rt.cache is not None else None
        return regions, cache

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self, job: Job) -> None:
        self.current, self._before = job, None
        reply: Reply | None = None
        error: BaseException | None = None
        try:
            if self.fault is not None:
                raise StrataError(self.fault)
            if job.cancel_event.is_set():  # its client left before it started
                reply = Reply("", Timing(), cancelled=True)
            else:
                r = job.request
                try:
                    job.max_new = job.fit(self.prompt_tokens(r))
                except RequestError:
                    job.refused = True
                    raise
                job.accept()
                reply = self.loop.chat(conversation(r), r.prompt, r.params, job.max_new,
                                       on_text=job.put, stop=r.stop, cancel=job.cancel_event)
        except Exception as exc:
            error = exc
            if not isinstance(exc, StrataError):  # our bug: its text goes to the log only
                log.error("a request failed on the engine thread", exc_info=exc)
        finally:
            self.current = None
            if not job.refused:  # a refused prompt ran nothing: no outcome, nothing to check
                self._after(reply, error)
            job.finish(reply, error)

    def _after(self, reply: Reply | None, error: BaseException | None) -> None:
        outcome = "failed" if error else "cancelled" if reply and reply.cancelled else "completed"
        self.outcomes[outcome] += 1
        self.on_outcome(outcome)
        if reply is not None and not reply.cancelled:
            self.on_line(reply.timing.line())
        elif self._before is not None:
            self.on_line(f"strata serve: request {outcome} after {reply.timing.generated if reply else 0} "
                         "generated tokens; rolled back")
        try:
            self.loop.rt.check_integrity()
        except AssertionError as exc:
            self.fault = f"the engine's state check failed after a request: {exc}"
        if outcome != "completed" and self._before is not None:
            now = self.idle_state()
            if now != self._before:
                self.fault = (f"a {outcome} request left the engine unlike before it: "
                              f"{self._before} became {now}")
        if self.fault is not None:
            self.on_line(f"strata serve: error: {self.fault}; restart the server")

    def _on_event(self, e: Event) -> None:  # the engine thread, during a request
        job = self.current
        if job is None:
            return
        if isinstance(e, RequestStarted):  # flags applied, nothing lent or released yet
            self._before = self.idle_state()
        elif isinstance(e, PrefillProgress):
            job.put(e)
