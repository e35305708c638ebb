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

import numpy as np

from engine.config import EngineOptions, LoanFlags
from engine.devices import hardware_name
from engine.errors import ContextFullError, FlagError, StrataError, TokenizerError
from engine.faults import Faults
from engine.loan.forecast import (
    LoanVerdict,
    Rates,
    pays,
    routing_odds,
)
from engine.loan.transaction import REPEAT, STARTUP, admission
from engine.request.conversation import Conversation, check_prompt_fits, check_text_fits
from engine.request.record import Request, reused_tokens
from engine.request.sampler import SamplingParams
from engine.request.stops import StopStrings
from engine.runtime import flags as runtime_flags
from engine.runtime.learning import ForecastLearner, PolicyKeeper
from engine.runtime.parts import Runtime
from engine.runtime.stages import (
    CANCELLED,
    DONE,
    FAILED,
    Answer,
    Ask,
    Finished,
    decode,
    prefill,
    rollback,
)
from engine.runtime.workload import request_workload
from engine.startup.cache import startup_profile
from engine.startup.runtime import build_runtime
from engine.trace.events import (
    EventBus,
    PlanChosen,
    PrefillProgress,
    RequestDone,
    RequestStarted,
    TraceLine,
)
from engine.trace.timing import Timing


class Cancelled(StrataError):
    """The request was cancelled by the user; state was rolled back."""

    is_cancel = True


@dataclass
class Reply:
    """The answer to one request; a cancelled one holds the text generated before the cancel."""

    text: str
    timing: Timing
    cancelled: bool = False
    verdict: LoanVerdict | None = None  # the loan and the forecast made before it ran
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
        self.pending = runtime_flags.PendingFlags(runtime, self.bus)  # for the next request
        self._conv_id: str | None = None  # the conversation whose tokens the KV holds
        self._request_id = 0
        device = hardware_name(runtime.backend.device_index)
        self.learner = ForecastLearner(runtime, self._routing_odds(), device)
        self.keeper = PolicyKeeper(runtime, self.learner.rates_file, device)
        self._running: list[int] | None = None  # the prompt of the request in flight
        # told of each request's end, in order, before its RequestDone is published
        self.on_done: list[Callable[[Finished], None]] = [self.learner.on_done,
                                                          self.keeper.on_done]

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
        """The next request's options (a pending change included)."""
        return self.pending.options

    @property
    def flags(self) -> LoanFlags:
        """The next request's loan flags (a pending change included)."""
        return self.pending.flags

    @property
    def rates(self) -> Rates:
        """The forecast's rates on this device (`learner`); a benchmark may set them."""
        return self.learner.rates

    @rates.setter
    def rates(self, rates: Rates) -> None:
        self.learner.rates = rates

    @property
    def odds(self) -> np.ndarray:
        return self.learner.odds

    @property
    def busy(self) -> bool:
        return self._busy.locked()

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` (no template); text that cannot fit --ctx is refused unread."""
        check_text_fits([text], self.options.ctx)
        return len(self.rt.model.tokenizer.encode(text, special=False))

    def prompt_ids(self, conv: Conversation) -> list[int]:
        return self._encode(conv.as_dicts())

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's prompt ids through the chat template; a template that renders
        no token for it is a TokenizerError (a prompt needs at least one token)."""
        check_text_fits((m["content"] for m in messages), self.options.ctx)
        tok = self.rt.model.tokenizer
        ids = tok.encode(tok.render_chat(messages, add_generation_prompt=True))
        if not ids:
            raise TokenizerError("the chat template renders an empty prompt for this "
                                 "conversation; fix tokenizer.chat_template in the model file")
        return ids

    def preview(self, conv: Conversation, text: str) -> LoanVerdict:
        """What sending `text` in `conv` next would do: its prompt and fresh tokens, the loan it
        would get (or why not) and the forecast with and without one. Tokenizes the whole
        conversation: call it off the UI thread. A question: nothing changes. A message that
        leaves no room in --ctx to answer is a ContextFullError, as sending it would be."""
        before = conv.as_dicts()
        ids = self._encode([*before, {"role": "user", "content": text}])
        self._check_fits(ids, before, text)
        reused = 0  # another conversation: its KV starts empty
        if conv.id == self._conv_id:  # the request's own rule (a request in flight: its prompt)
            reused = reused_tokens(self.rt.session, self.rt.spec, ids, held=self._running)
        return self.verdict(len(ids), reused)

    def _check_fits(self, ids: list[int], before: list[dict[str, str]], text: str) -> None:
        """A ContextFullError with the numbers when the prompt `ids` (the messages `before`,
        then `text`) leaves no room to answer: the message's own tokens and whether a new
        conversation (its system messages kept) would hold it."""
        ctx = self.rt.options.ctx
        try:
            check_prompt_fits(len(ids), ctx)
        except ContextFullError:
            alone = [m for m in before if m["role"] == "system"]
            n_alone = len(self._encode([*alone, {"role": "user", "content": text}]))
            raise ContextFullError(len(ids), ctx, self.count_tokens(text),
                                   fits_alone=n_alone < ctx) from None

    def verdict(self, n_prompt: int, reused: int, flags: LoanFlags | None = None,
                options: EngineOptions | None = None) -> LoanVerdict:
        """The loan a prompt of `n_prompt` tokens (the KV keeping its first `reused`) would get
        under `flags` and `options` (the next request's by default), why, and the forecast
        with and without a loan (engine.loan.forecast). A question: nothing changes."""
        flags, options = flags or self.flags, options or self.options
        rt, rates = self.rt, self.rates
        n_fresh = n_prompt - reused
        pending = not rt.prefilled and flags.elastic_loan  # what the next request arms
        without = rates.forecast(request_workload(rt, None, n_fresh, reused, self.odds, flags, options))
        with_loan = None
        if flags.elastic_loan and (pending or flags.repeat_loan):
            kind = STARTUP if pending else REPEAT
            with_loan = rates.forecast(request_workload(rt, kind, n_fresh, reused, self.odds, flags,
                                                   options))
        gain = pays(without, with_loan) if with_loan is not None else None
        kind, reason = admission(flags, pending, n_fresh, gain)
        return LoanVerdict(n_prompt, n_fresh, kind, reason, without, with_loan, gain)

    def what_if(self, flags: LoanFlags, options: EngineOptions, n_fresh: int) -> LoanVerdict:
        """`verdict` of an `n_fresh`-token message under flags and options not yet applied;
        FlagError with every violation when the guards would refuse them."""
        violations = runtime_flags.validate(self.rt, options, flags)
        if violations:
            raise FlagError(violations)
        return self.verdict(n_fresh, 0, flags, options)

    def _routing_odds(self) -> np.ndarray:
        """Routing odds in the cache's fill order, from the profile it was filled from
        (loaded from where startup cached it); uniform without an expert cache."""
        rt = self.rt
        hp = rt.model.hp
        profile = None
        if rt.cache is not None:
            profile = startup_profile(rt.options.expert_profile, rt.model, rt.backend)
        return routing_odds(profile, hp.n_moe_layer, hp.n_expert, hp.n_expert_used)

    # -- actions ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the engine (`Runtime.close`): every byte it holds on the device goes back."""
        self.rt.close()

    def cancel(self) -> None:
        """Ask the running request to stop; it rolls back at the next chunk or token."""
        self._cancel.set()

    def set_flags(self, flags: LoanFlags, options: EngineOptions | None = None) -> list[str]:
        """Validate new flags/options with the guards; apply them from the next request
        (`pending`). Returns the violations (empty when accepted). Never changes a running
        request."""
        return self.pending.offer(flags, options)

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
            self.pending.take()
            self._cancel = cancel or threading.Event()
            return converse(conv, user_text, lambda: self._answer(
                conv, params or SamplingParams(), max_new, on_text, stop))
        finally:
            self._busy.release()

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
            self.pending.take()
            self._cancel = cancel or threading.Event()
            self._conv_id = None
            return self.step(Ask(ids, params or SamplingParams(), max_new, stop, on_text))
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
        ids = self.prompt_ids(conv)
        messages = conv.as_dicts()
        self._check_fits(ids, messages[:-1], messages[-1]["content"])  # before the KV changes
        if conv.id != self._conv_id:  # another conversation: its KV starts empty
            self.rt.rollback(0)
            self._conv_id = conv.id
        return self.step(Ask(ids, params, max_new, stop, on_text))

    def step(self, ask: Ask) -> Reply:
        """One request, top to bottom: admit -> plan -> prefill -> decode -> done. A cancel or
        a failure rolls the engine back to the reused prefix; a cancel returns the text said
        before it, a failure re-raises once the request is done. Runs under the request lock
        (`chat`, `complete`: one request at a time, its own cancel event)."""
        assert self._busy.locked(), "step runs inside chat or complete"
        if not ask.ids:
            raise StrataError("the prompt is empty; give at least one token")
        check_prompt_fits(len(ask.ids), self.rt.options.ctx)
        req = self._admit(ask.ids)
        verdict = self._plan(req)
        answer = Answer(StopStrings(ask.stop), self.bus, ask.on_text)
        t0 = time.perf_counter()
        try:
            logits = prefill(self.rt, req, self, t0)
            decode(self.rt, req, logits, ask, answer, self._cancel, t0)
            if self._cancel.is_set():
                raise Cancelled("cancelled")
        except BaseException as exc:
            rollback(self.rt, req, t0)
            cancelled = isinstance(exc, Cancelled)
            self._done(Finished(req, verdict, CANCELLED if cancelled else FAILED,
                                "" if cancelled else failure_line(exc)))
            if not cancelled:
                raise
            return Reply(answer.text, req.timing, cancelled=True, verdict=verdict)
        self._done(Finished(req, verdict, DONE))
        return Reply(answer.text, req.timing, finish_reason=answer.finish, verdict=verdict)

    def _admit(self, ids: list[int]) -> Request:
        """The request record: the reuse rule applied to the KV (and the draft), its counts
        published."""
        self._request_id += 1
        req = Request.start(self._request_id, ids, self.rt.session, self.rt.spec)
        self._running = ids
        self.bus.publish(RequestStarted(req.id, len(ids), len(req.fresh)))
        return req

    def _plan(self, req: Request) -> LoanVerdict:
        """The loan this request would get and the forecast with and without one; the
        forecast's verdict goes on the record (the runtime's `admit` reads it under
        threshold auto, and plans the geometry with the loan it grants)."""
        verdict = self.verdict(len(req.ids), req.reused)
        req.loan_pays = verdict.pays
        return verdict

    def _done(self, finished: Finished) -> None:
        """The request is over: its subscribers (`on_done`: the forecast learns, the drafting
        policy is kept) and then its RequestDone (with what they set on its timing)."""
        self._running = None
        for subscriber in self.on_done:
            subscriber(finished)
        req = finished.request
        done = RequestDone.of(req.timing, cancelled=finished.outcome == CANCELLED,
                              error=finished.error)
        self.bus.publish(TraceLine(done.line))
        self.bus.publish(done)

    # -- the request's progress (engine.request.record.Progress) -------------------------------
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
        self.bus.publish(PrefillProgress(index + 1, req.n_chunks, req.tokens_read,
                                         len(req.fresh), seconds * 1e3))
        if self._cancel.is_set():
            raise Cancelled("cancelled during prefill")


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


def failure_line(exc: BaseException) -> str:
    """A failed request's one line for its RequestDone: a typed error's own words; for
    anything else (our bug, an interrupt) its kind only (the traceback goes to the log)."""
    if isinstance(exc, StrataError):
        return str(exc) or type(exc).__name__
    return f"{type(exc).__name__} (an internal error)"

