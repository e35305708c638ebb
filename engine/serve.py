"""ServeLoop: the serialized serve loop the app and `strata chat` use.

One request at a time: admit, tokenize, count fresh tokens, decide loan or no loan, prefill
chunk by chunk, restore, decode. Every step publishes events on the bus; a cancel (from any
thread) or a failure rolls the request back and keeps the conversation as it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.build.startup import build_runtime
from engine.config import EngineOptions, LoanFlags
from engine.conversation import Conversation
from engine.errors import StrataError
from engine.events import (
    EventBus,
    FlagsChanged,
    FlagsRefused,
    PlanChosen,
    PrefillProgress,
    RequestDone,
    RequestStarted,
    Token,
    TraceLine,
)
from engine.experts.provider import StreamCounters
from engine.faults import Faults
from engine.request import Request
from engine.runtime import Runtime
from engine.sampler import Sampler, SamplingParams
from engine.stops import StopStrings
from engine.timing import Timing


class Cancelled(StrataError):
    """The request was cancelled by the user; state was rolled back."""

    is_cancel = True


@dataclass
class Reply:
    """The answer to one request; a cancelled one holds the text generated before the cancel."""

    text: str
    timing: Timing
    cancelled: bool = False
    # "stop": an end-of-generation token or a stop string; "length": max_new or a full context
    finish_reason: str = "length"

    @property
    def withdrawn(self) -> bool:
        """Cancelled before any text: the prompt is not kept in the conversation."""
        return self.cancelled and not self.text


class ServeLoop:
    """Runs chat requests against one loaded engine, strictly one at a time."""

    def __init__(self, runtime: Runtime, bus: EventBus | None = None):
        self.rt = runtime
        self.bus = bus or runtime.bus
        self._cancel = threading.Event()  # the running request's (each request gets its own)
        self._busy = threading.Lock()
        self._flags_lock = threading.Lock()  # pending flags: set by any thread, taken by a request
        self._pending_flags: LoanFlags | None = None
        self._pending_options: EngineOptions | None = None
        self._conv_id: str | None = None  # the conversation whose tokens the KV holds
        self._request_id = 0

    @classmethod
    def create(
        cls,
        options: EngineOptions,
        flags: LoanFlags | None = None,
        bus: EventBus | None = None,
        on_trace: Callable[[str], None] | None = None,
        faults: Faults | None = None,
    ) -> ServeLoop:
        """Load the model and plan memory; publishes Loading, LedgerChanged and Ready.

        `on_trace` receives the text lines (plan, trace, loan) the CLI prints; trace and loan
        lines only when STRATA_TRACE=1.
        """
        bus = bus or EventBus()
        return cls(build_runtime(options, flags or LoanFlags(), bus, on_trace, faults), bus)

    # -- questions -------------------------------------------------------------------------
    @property
    def options(self) -> EngineOptions:
        return self._pending_options or self.rt.options

    @property
    def flags(self) -> LoanFlags:
        return self._pending_flags or self.rt.flags

    @property
    def busy(self) -> bool:
        return self._busy.locked()

    def count_tokens(self, text: str) -> int:
        return len(self.rt.model.tokenizer.encode(text, special=False))

    def prompt_ids(self, conv: Conversation) -> list[int]:
        tok = self.rt.model.tokenizer
        return tok.encode(tok.render_chat(conv.as_dicts(), add_generation_prompt=True))

    # -- actions ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the engine (`Runtime.close`): every byte it holds on the device goes back."""
        self.rt.close()

    def cancel(self) -> None:
        """Ask the running request to stop; it rolls back at the next chunk or token."""
        self._cancel.set()

    def set_flags(self, flags: LoanFlags, options: EngineOptions | None = None) -> list[str]:
        """Validate new flags/options with the guards; apply them from the next request.

        Returns the violations (empty when accepted). Never changes a running request.
        """
        with self._flags_lock:
            options = options or self.options
            violations = self.rt.validate(options, flags)
            if violations:
                self.bus.publish(FlagsRefused(tuple(violations)))
                return violations
            self._pending_flags, self._pending_options = flags, options
            self.bus.publish(FlagsChanged(tuple(sorted(flags.as_env().items())) + (
                ("spec", str(options.spec)), ("prefill", str(options.prefill)))))
        return []

    def chat(
        self,
        conv: Conversation,
        user_text: str,
        params: SamplingParams | None = None,
        max_new: int = 256,
        on_text: Callable[[str], None] | None = None,
        stop: Sequence[str] = (),
        cancel: threading.Event | None = None,
    ) -> Reply:
        """Add `user_text` to `conv`, answer it, and append the answer. Blocking.

        On failure, or a cancel before any text, the conversation and the engine state are as
        before the call. A cancel after some text keeps the prompt and the partial answer
        (marked cancelled) in the conversation: the user saw it, so the next prompt includes
        it. A cancel returns `Reply(cancelled=True)`, a failure re-raises after rollback.
        The answer ends before the first of the `stop` strings. `cancel` is this request's
        own cancel event (a server's request cancelled before it starts stays cancelled);
        without it `cancel()` stops the request.
        """
        if not self._busy.acquire(blocking=False):
            raise StrataError("a request is already running; wait for it or cancel it")
        try:
            self._apply_pending()
            self._cancel = cancel or threading.Event()
            return converse(conv, user_text, lambda: self._answer(
                conv, params or SamplingParams(), max_new, on_text, stop))
        finally:
            self._busy.release()

    def _apply_pending(self) -> None:
        with self._flags_lock:
            if self._pending_flags or self._pending_options:
                self.rt.apply(self._pending_options or self.rt.options,
                              self._pending_flags or self.rt.flags)
                self._pending_flags = self._pending_options = None

    def complete(
        self,
        ids: list[int],
        params: SamplingParams | None = None,
        max_new: int = 256,
        on_text: Callable[[str], None] | None = None,
        stop: Sequence[str] = (),
        cancel: threading.Event | None = None,
    ) -> Reply:
        """Generate after raw prompt ids (no chat template): `strata run --tokens-file`, bench."""
        if not self._busy.acquire(blocking=False):
            raise StrataError("a request is already running; wait for it or cancel it")
        try:
            self._apply_pending()
            self._cancel = cancel or threading.Event()
            self._conv_id = None
            return self._generate(ids, params or SamplingParams(), max_new, on_text, stop)
        finally:
            self._busy.release()

    def _answer(
        self,
        conv: Conversation,
        params: SamplingParams,
        max_new: int,
        on_text: Callable[[str], None] | None,
        stop: Sequence[str],
    ) -> Reply:
        """Answer the last message of `conv` (the user's, just added)."""
        if conv.id != self._conv_id:  # another conversation: its KV starts empty
            self.rt.rollback(0)
            self._conv_id = conv.id
        return self._generate(self.prompt_ids(conv), params, max_new, on_text, stop)

    def _generate(
        self,
        ids: list[int],
        params: SamplingParams,
        max_new: int,
        on_text: Callable[[str], None] | None,
        stop: Sequence[str] = (),
    ) -> Reply:
        """admit -> plan and prefill (the runtime) -> decode -> done; on cancel or failure
        roll back to the reused prefix and publish the outcome."""
        rt, tok = self.rt, self.rt.model.tokenizer
        req = self._admit(ids)
        timing = req.timing
        pieces: list[str] = []
        stops = StopStrings(stop)
        finish = "length"
        t0 = time.perf_counter()
        try:
            logits = rt.prefill(req, self)
            timing.prefill_s = time.perf_counter() - t0
            before = _expert_reads(rt.experts.counters)
            stream = tok.stream()
            t1 = time.perf_counter()
            for token in rt.decode(logits, Sampler(params), max_new, tok.eog_ids, timing,
                                   self._cancel):
                if timing.generated == 1:
                    timing.ttft_s = time.perf_counter() - t0
                if token in tok.eog_ids:
                    finish = "stop"
                    break
                self._emit(stops.push(stream.push(token)), pieces, on_text)
                if stops.hit is not None:
                    break
            self._emit(stops.push(stream.flush()) + stops.flush(), pieces, on_text)
            if stops.hit is not None:
                finish = "stop"
            timing.decode_s = time.perf_counter() - t1
            after = _expert_reads(rt.experts.counters)
            timing.decode_hits, timing.decode_misses = (a - b for a, b in zip(after, before))
            rt.trace_decode(timing)
            if self._cancel.is_set():
                raise Cancelled("cancelled")
        except BaseException as exc:
            rt.rollback(req.reused)
            self._done(req, cancelled=True)
            if isinstance(exc, Cancelled):
                return Reply("".join(pieces), timing, cancelled=True)
            raise
        self._done(req)
        return Reply("".join(pieces), timing, finish_reason=finish)

    def _admit(self, ids: list[int]) -> Request:
        """The request record: the reuse rule applied to the KV (and the draft), its counts
        published."""
        self._request_id += 1
        req = Request.start(self._request_id, ids, self.rt.session, self.rt.spec)
        self.bus.publish(RequestStarted(req.id, len(ids), len(req.fresh)))
        return req

    def _emit(self, text: str, pieces: list[str], on_text: Callable[[str], None] | None) -> None:
        if text:
            pieces.append(text)
            self.bus.publish(Token(text))
            if on_text:
                on_text(text)

    # -- the request's progress (engine.request.Progress) ----------------------------------
    def planned(self, req: Request) -> None:
        """The runtime chose the loan and the prompt geometry."""
        g = req.geometry
        assert g is not None
        loan = req.loan is not None
        self.bus.publish(PlanChosen(g.chunk_tokens, g.ring_slots, loan, req.n_chunks,
                                    len(req.fresh), g.reasons))
        self.rt.report.say(f"strata serve: prompt plan {g.label} (chunk tokens / ring slots), "
                           f"loan {'on' if loan else 'off'}")

    def chunk(self, req: Request, index: int, seconds: float) -> None:
        """Chunk `index` is done: progress, then stop here if the user cancelled."""
        assert req.geometry is not None
        done = min(len(req.fresh), (index + 1) * req.geometry.chunk_tokens)
        self.bus.publish(PrefillProgress(index + 1, req.n_chunks, done, len(req.fresh),
                                         seconds * 1e3))
        if self._cancel.is_set():
            raise Cancelled("cancelled during prefill")

    def _done(self, req: Request, cancelled: bool = False) -> None:
        done = RequestDone.of(req.timing, cancelled=cancelled)
        self.bus.publish(TraceLine(done.line))
        self.bus.publish(done)


def converse(conv: Conversation, user_text: str, answer: Callable[[], Reply]) -> Reply:
    """One exchange of a conversation: add the user's message, `answer()` it, keep what the
    user saw. A failure, or a cancel before any text, leaves `conv` as before; a cancel after
    some text keeps the partial answer, marked cancelled (the next prompt includes it). The
    one owner of that rule: the serve loop and the app's remote link answer through it."""
    conv.add("user", user_text)
    try:
        reply = answer()
    except BaseException:
        conv.pop()
        raise
    if reply.withdrawn:
        conv.pop()
    else:  # the KV was rolled back: the next prompt re-reads this exchange from its text
        conv.add("assistant", reply.text, cancelled=reply.cancelled)
    return reply


def _expert_reads(c: StreamCounters) -> tuple[int, int]:
    """(hits, misses) so far of the engine's expert provider counters."""
    return c.hits, c.streamed + c.host_reads
