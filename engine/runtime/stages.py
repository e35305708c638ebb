"""A request's stages on the runtime, as `ServeLoop.step` runs them: prefill (the loan and the
prompt path, inside the runtime), decode into the answer, and the rollback after a cancel or a
failure; the records they pass (`Ask`: what a caller asks; `Answer`: the reply as it streams;
`Finished`: a request's end, as the serve loop's `on_done` subscribers get it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.experts.provider import StreamCounters
from engine.loan.forecast import LoanVerdict
from engine.request.record import Progress, Request
from engine.request.sampler import Sampler, SamplingParams
from engine.request.stops import StopStrings
from engine.runtime.parts import Runtime
from engine.trace.events import EventBus, Token

DONE, CANCELLED, FAILED = "done", "cancelled", "failed"  # how a request ended


@dataclass(frozen=True)
class Ask:
    """What a caller asks of one request: the prompt's ids and how to answer them."""

    ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 256
    stop: Sequence[str] = ()  # the answer ends before the first of these
    on_text: Callable[[str], None] | None = None  # each piece of text as it is said


@dataclass
class Answer:
    """The reply's text as it streams: cut before a stop string, each piece published as a
    Token event (and told to the caller's `on_text`), and why it ended."""

    stops: StopStrings
    bus: EventBus
    on_text: Callable[[str], None] | None = None
    pieces: list[str] = field(default_factory=list)
    finish: str = "length"  # "stop": an end-of-generation token or a stop string

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, text: str) -> bool:
        """Decoded text in; True once a stop string is hit (the answer ends there)."""
        self._say(self.stops.push(text))
        return self.stops.hit is not None

    def close(self, text: str) -> None:
        """The decoder's last text in, and the tail held back for a stop string out."""
        self._say(self.stops.push(text) + self.stops.flush())
        if self.stops.hit is not None:
            self.finish = "stop"

    def _say(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            self.bus.publish(Token(text))
            if self.on_text:
                self.on_text(text)


@dataclass(frozen=True)
class Finished:
    """A request's end: the record, the loan verdict it ran under, the outcome."""

    request: Request
    verdict: LoanVerdict
    outcome: str  # DONE, CANCELLED or FAILED
    error: str = ""  # a failure's one line (engine.runtime.serve.failure_line)


def prefill(rt: Runtime, req: Request, progress: Progress, t0: float) -> Any:
    """Plan and prefill the request's fresh tokens (the loan `admit` grants, or none); the
    first token's logits [1, V]. `t0`: when the request started (its prefill time)."""
    logits = rt.prefill(req, progress)
    req.timing.prefill_s = time.perf_counter() - t0
    req.prefilled = True
    return logits


def decode(rt: Runtime, req: Request, logits: Any, ask: Ask, answer: Answer,
           cancel: threading.Event, t0: float) -> None:
    """Tokens after the prompt's `logits` into `answer` until an end-of-generation token, a
    stop string, `ask.max_new` or a cancel; the decode's time and expert reads on the
    request's timing, then the draft model's deferred catch-up (after the timing)."""
    tok, timing = rt.model.tokenizer, req.timing
    before = expert_reads(rt.experts.counters)
    stream = tok.stream()
    t1 = time.perf_counter()
    for token in rt.decode(logits, Sampler(ask.params), ask.max_new, tok.eog_ids, timing,
                           cancel):
        if timing.generated == 1:
            timing.ttft_s = time.perf_counter() - t0
        if token in tok.eog_ids:
            answer.finish = "stop"
            break
        if answer.push(stream.push(token)):
            break
    answer.close(stream.flush())
    timing.decode_s = time.perf_counter() - t1
    after = expert_reads(rt.experts.counters)
    timing.decode_hits, timing.decode_misses, timing.decode_promoted, timing.decode_bytes = (
        a - b for a, b in zip(after, before))
    rt.trace_decode(timing)
    rt.settle()


def rollback(rt: Runtime, req: Request, t0: float) -> None:
    """After a cancel or a failure: what the prefill read if it stopped inside it, and how
    long it ran; the engine back to the reused prefix; the draft settled without raising."""
    timing = req.timing
    if not timing.prefill_s:
        timing.prefill_s = time.perf_counter() - t0
        timing.read_tokens = req.tokens_read
    rt.rollback(req.reused)
    rt.settle(quiet=True)


def expert_reads(c: StreamCounters) -> tuple[int, int, int, int]:
    """(hits, misses, promotions, bytes streamed) so far of the engine's expert provider
    counters."""
    return c.hits, c.streamed + c.host_reads, c.promoted, c.bytes_streamed
