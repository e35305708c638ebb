"""The prompt path: chunked prefill with experts read in place or streamed through the ring.

Per chunk and layer the router picks experts; resident ones are read from their cache slot,
the others are uploaded into the staging ring (only the experts the chunk uses) and decoded
from there. The chunk buffer and the ring are carved from lent cache-tail slots (borrowed) or
from the owned `prompt.*` regions. Counters report bytes streamed, experts streamed and hits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.backend.base import Backend
from engine.experts.cache import ExpertCache, LentRange
from engine.experts.provider import CachedExperts, StreamCounters
from engine.faults import Faults
from engine.memory.arena import Arena
from engine.memory.compute_arena import ArenaStats
from engine.memory.ledger import Ledger
from engine.memory.plan_types import ModelCosts, PromptGeometry, chunk_count
from engine.memory.ring import StagingRing, split_prompt_buffer
from engine.model.transformer import PromptChunk
from engine.request.session import Session
from engine.trace.events import LoanStep
from engine.trace.phases import PhaseClock
from engine.trace.report import Reporter


@dataclass(frozen=True)
class PrefillResult:
    """What the prompt path did: chunks run, the provider's stream counters, the lend and
    refill trace lines."""

    n_chunks: int
    counters: StreamCounters
    refill_trace: str = ""
    lend_trace: str = ""


def shrink_geometry(g: PromptGeometry, n_fresh: int, act_bytes_per_token: int,
                    act_bytes_fixed: int, blob_bytes: int) -> PromptGeometry:
    """A prompt shorter than the chunk needs only its own activations: lend fewer slots."""
    if n_fresh >= g.chunk_tokens:
        return g
    chunk_bytes = act_bytes_fixed + n_fresh * act_bytes_per_token
    n_lent = -(-(chunk_bytes + g.ring_bytes) // blob_bytes) if g.borrowed else 0
    return PromptGeometry(n_fresh, g.ring_slots, n_lent, chunk_bytes, g.ring_bytes, g.borrowed,
                          g.reasons)


class PromptPath:
    """The prompt path of one engine: the owned `prompt.*` regions (a plan that does not
    borrow), the range lent from the cache tail while a prompt runs, and the chunk loop.

    `run` lends, prefills and always refills, interrupted too (a failure, a cancel); a
    refill that failed twice is tried once more there, and the loan's undo path asks
    `refill_pending` again for what is still lent.
    """

    def __init__(self, ledger: Ledger, prompt: PromptGeometry, costs: ModelCosts,
                 cache: ExpertCache | None, provider: CachedExperts, backend: Backend,
                 faults: Faults, report: Reporter):
        self.costs, self.cache, self.provider, self.backend = costs, cache, provider, backend
        self.faults, self.report = faults, report
        self.chunk: Arena | None = None
        self.ring: Arena | None = None
        if prompt.chunk_tokens and not prompt.borrowed:
            self.chunk = Arena(ledger, "prompt.chunk", prompt.chunk_bytes)
            self.ring = Arena(ledger, "prompt.ring", prompt.ring_bytes)
        self.lent: LentRange | None = None  # cache slots the running prompt holds
        self.arena_stats: ArenaStats | None = None  # the last prompt's temporaries (CUDA)

    @property
    def owned(self) -> tuple[Arena | None, Arena | None]:
        """The owned prompt regions (prompt.chunk, prompt.ring), None where borrowed."""
        return self.chunk, self.ring

    @property
    def owned_bytes(self) -> int:
        return sum(a.n_bytes for a in self.owned if a is not None)

    def fit(self, g: PromptGeometry, n_fresh: int) -> PromptGeometry:
        """`g` cut down to a prompt of `n_fresh` tokens (fewer slots lent for a short one)."""
        c = self.costs
        return shrink_geometry(g, n_fresh, c.act_bytes_per_token, c.act_bytes_fixed,
                               c.expert_blob_bytes)

    def run(self, session: Session, fresh: list[int], g: PromptGeometry,
            on_chunk: Callable[[int, int, float], None],
            clock: PhaseClock | None = None) -> PrefillResult:
        """Prefill `fresh` with geometry `g` chunk by chunk; lends and always refills.
        `clock`: where the chunks' phases go (STRATA_TRACE); `arena_stats` afterwards holds
        what the chunks' temporaries took (CUDA)."""
        blob = self.provider.host.blob_bytes
        if g.borrowed:
            assert self.cache is not None
            self.lent = self.cache.lend_tail(g.n_lent_slots, chunk_tokens=g.chunk_tokens)
            chunk_buf, ring_slots = split_prompt_buffer(self.lent.view, g.chunk_bytes,
                                                        g.ring_slots, blob)
        else:
            assert self.chunk is not None and self.ring is not None, \
                "an owned prompt geometry needs the prompt.* regions"
            assert self.chunk.region is not None and self.ring.region is not None
            chunk_buf = self.chunk.region.view(0, g.chunk_bytes)
            ring_slots = self.ring.region.view(0, g.ring_slots * blob).reshape(g.ring_slots, blob)
        lend_trace = refill_trace = ""
        try:
            if self.lent is not None:
                lend_trace = self.lent.trace
                self.report.publish(LoanStep("lend", lend_trace, self.lent.n_slots * blob,
                                             self.lent.elapsed_ms))
            self.report.cache(self.cache)
            try:
                self.faults.hit("lent")
                self.provider.attach_ring(StagingRing(self.backend, ring_slots))
                self.provider.counters.reset()
                chunk = PromptChunk(chunk_buf, clock)
                self.arena_stats = None
                session.prefill(fresh, g.chunk_tokens, on_chunk, logits="none", chunk=chunk)
                self.arena_stats = chunk.arena
            finally:
                self.provider.attach_ring(None)
            if self.lent is not None:
                self.faults.hit("refill")
                refill_trace = self.refill_pending()
        except BaseException:
            self.refill_pending()  # interrupted: the lent slots back before anything else
            raise
        return PrefillResult(chunk_count(len(fresh), g.chunk_tokens), self.provider.counters,
                             refill_trace, lend_trace)

    def refill_pending(self) -> str:
        """Give back every slot the prompt path still holds (a one-shot device fault gets one
        retry); returns the refill's trace line. A failed attempt says so (a trace line and a
        warning, with the slots still lent); the retry's line counts the slots of both."""
        lent, self.lent = self.lent, None
        trace = ""
        if self.cache is not None and lent is not None and self.cache.n_lent:
            for attempt in (1, 2):
                t0 = time.perf_counter()
                try:
                    done = self.cache.refill(lent, on_slot=self._refill_slot)
                    trace = done.trace
                    self.report.publish(LoanStep("refill", trace, done.h2d_bytes,
                                                 done.elapsed_ms))
                    break
                except Exception as e:
                    self._refill_failed(lent, attempt, e, time.perf_counter() - t0)
                    if attempt == 2:
                        self.lent = lent
                        raise
        self.report.cache(self.cache)
        return trace

    def _refill_slot(self) -> None:
        self.faults.hit("refill:slot")

    def _refill_failed(self, lent: LentRange, attempt: int, e: Exception,
                       seconds: float) -> None:
        assert self.cache is not None
        still = self.cache.n_lent
        back = lent.n_slots - self.cache.lent_in(lent)
        then = "retrying once" if attempt == 1 else "giving up; the request rolls back"
        self.report.trace(f"strata trace: refill of {lent.n_slots} slots [{lent.first}.."
                          f"{lent.last}] failed after {back} in {seconds * 1e3:.1f} ms, "
                          f"{still} still lent ({e})")
        self.report.warn(f"strata: warning: refilling the lent expert-cache slots failed "
                         f"({e}); {still} of {lent.n_slots} still lent, {then}")
