"""One request: the record built once (ids, reused, fresh, loan, geometry, chunks, timing), the
progress sink it reports to, and the steps every caller shares — the reuse rule
(`reused_tokens`, a question the serve loop's preview asks too; `prompt_start` acts on it) and
decoding, plain or with drafts (`decode_tokens`).

The serve loop runs a request through the runtime (the loan, the prompt path); `generate`
runs one on a bare session (tests, `strata bench-spec`, the llama.cpp oracle) with the same
reuse rule and the same decoders.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.memory.plan_types import PromptGeometry
from engine.request.sampler import Sampler, SamplingParams
from engine.request.session import Session, reusable
from engine.speculative.decoder import SpecDecoder
from engine.trace.timing import Timing


@dataclass
class Request:
    """A request's facts, each set once: `ids` and `reused` when it starts, and the
    forecast's `loan_pays`; `loan`, `geometry` and `n_chunks` when the runtime plans its
    prefill; `timing`, `seconds` and `n_chunks_read` as it runs."""

    id: int
    ids: list[int]
    reused: int  # leading prompt tokens whose K/V the engine keeps
    timing: Timing = field(default_factory=Timing)
    loan: str | None = None  # "startup", "repeat" or None (engine.loan.transaction.admit)
    geometry: PromptGeometry | None = None  # the prompt plan its prefill runs with
    n_chunks: int = 0
    n_chunks_read: int = 0  # chunks the prefill finished (fewer than n_chunks if it stopped)
    prefilled: bool = False  # the prefill ran to its end (the first token's logits made)
    loan_pays: bool | None = None  # the forecast's verdict on a loan (threshold auto)
    # where its prefill time went: the prompt path's phases, the loan's release and restore
    seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, request_id: int, ids: list[int], session: Session,
              spec: SpecDecoder | None, timing: Timing | None = None) -> Request:
        """Apply the reuse rule to `session` (and the draft) and record the prompt's counts."""
        reused = prompt_start(session, spec, ids)
        timing = timing if timing is not None else Timing()
        timing.prompt_tokens, timing.reused_tokens = len(ids), reused
        timing.fresh_tokens = len(ids) - reused
        return cls(request_id, ids, reused, timing)

    @property
    def fresh(self) -> list[int]:
        """The prompt tokens this request computes."""
        return self.ids[self.reused:]

    @property
    def tokens_read(self) -> int:
        """Fresh tokens the prefill has read so far: finished chunks x chunk tokens (the last
        chunk is the prompt's rest)."""
        if self.geometry is None:
            return 0
        return min(len(self.ids) - self.reused, self.n_chunks_read * self.geometry.chunk_tokens)


class Progress(Protocol):
    """Where a running request's progress goes (the serve loop: events, cancel checks)."""

    def planned(self, request: Request) -> None:
        """The loan decision and the prompt geometry are set on `request`."""
        ...

    def chunk(self, request: Request, index: int, seconds: float) -> None:
        """Chunk `index` of `request.n_chunks` took `seconds`; raising here stops the prompt
        (the runtime rolls back)."""
        ...


def reused_tokens(session: Session, spec: SpecDecoder | None, ids: list[int],
                  held: list[int] | None = None) -> int:
    """The reuse rule, in one place: how many leading tokens of prompt `ids` a request keeps —
    the common prefix of the session's tokens and `ids` (never all of `ids`: the last prompt
    token is recomputed, its logits give the first new token) that the draft can continue
    from too. A question: nothing changes, nothing is allocated (the request itself acts on
    the answer: `prompt_start`). `held`: a request in flight's prompt, standing for the KV it
    will hold; an estimate, the KV's part only (the draft's cells are that request's until it
    settles)."""
    if held is not None:
        return reusable(held, ids)
    keep = session.reusable(ids)
    if spec is not None:
        keep = spec.draft.reusable(session, ids, keep)
    return keep


def prompt_start(session: Session, spec: SpecDecoder | None, ids: list[int]) -> int:
    """A request's begin step: the last request settled, the reuse rule asked
    (`reused_tokens`), the draft bound and cut and the session truncated to its answer.
    Returns it."""
    if spec is not None:
        spec.settle()  # the last request's deferred catch-up: the draft the rule reads
    keep = reused_tokens(session, spec, ids)
    if spec is not None:
        spec.begin(session, keep)
    session.truncate(keep)
    return keep


def decode_tokens(session: Session, spec: SpecDecoder | None, logits: Any, sampler: Sampler,
                  max_new: int, stop_ids: frozenset[int], timing: Timing,
                  cancel: threading.Event | None = None) -> Iterator[int]:
    """Tokens after the prompt's logits [.., V]: with drafts when `spec` is given, else plain."""
    if spec is not None:
        return spec.decode(session, logits, sampler, max_new, stop_ids, timing, cancel)
    return session.decode(logits, sampler, max_new, stop_ids, timing, cancel)


def generate(
    session: Session,
    ids: list[int],
    max_new: int,
    params: SamplingParams,
    chunk_tokens: int = 512,
    stop_ids: frozenset[int] = frozenset(),
    timing: Timing | None = None,
    spec: SpecDecoder | None = None,
) -> Iterator[int]:
    """A request on a bare session (no runtime, no loan): reuse a common prefix, prefill the
    rest in chunks, then decode (with `spec`'s drafts when given)."""
    req = Request.start(0, ids, session, spec, timing)
    timing = req.timing
    t0 = time.perf_counter()
    prev = session.on_hidden
    if spec is not None:  # the draft reads every prompt chunk's hidden
        session.on_hidden = spec.collect
    try:
        logits = session.prefill(req.fresh, chunk_tokens)  # [1, V]
    finally:
        session.on_hidden = prev
    timing.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    tokens = decode_tokens(session, spec, logits, Sampler(params), max_new, stop_ids, timing)
    try:
        for tok in tokens:
            if timing.generated == 1:
                timing.ttft_s = time.perf_counter() - t0
            yield tok
    finally:
        tokens.close()  # settles the KV now, not when the generator is collected
        timing.decode_s = time.perf_counter() - t1
        if spec is not None:  # the draft model's deferred catch-up, after the timing (a
            # consumer that stopped early closed this generator: still a reply to settle)
            failure = sys.exc_info()[1]
            spec.settle(quiet=failure is not None and not isinstance(failure, GeneratorExit))
