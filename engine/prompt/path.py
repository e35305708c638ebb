"""The prompt path: chunked prefill with experts read in place or streamed through the ring.

Per chunk and layer the router picks experts; resident ones are read from their cache slot,
the others are uploaded into the staging ring (only the experts the chunk uses) and decoded
from there. The chunk buffer and the ring are carved from lent cache-tail slots (borrowed) or
from the owned `prompt.*` regions. Counters report bytes streamed, experts streamed and hits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.backend.base import Backend
from engine.experts.cache import ExpertCache
from engine.experts.provider import CachedExperts, StreamCounters
from engine.memory.plan_types import PromptGeometry
from engine.memory.ring import StagingRing, split_prompt_buffer
from engine.session import Session


@dataclass(frozen=True)
class PrefillResult:
    logits: Any
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


def run_prompt(
    session: Session,
    fresh: list[int],
    g: PromptGeometry,
    cache: ExpertCache | None,
    provider: CachedExperts,
    backend: Backend,
    owned: tuple[Any, Any] | None,
    on_chunk: Callable[[int, int, float], None] | None = None,
    hook: Callable[[str, Any], None] | None = None,
) -> PrefillResult:
    """Prefill `fresh` with geometry `g`; lends and always refills the cache tail.

    `owned` is (chunk bytes, ring bytes) of the owned prompt regions when `g` is not borrowed.
    `hook(event, lent)` is called with 'lent' after lending and 'refill' before refilling (the
    runtime tracks the lent range there and tests inject faults).
    """
    blob = provider.host.blob_bytes
    hook = hook or (lambda event, lent: None)
    lent = None
    if g.borrowed:
        assert cache is not None
        lent = cache.lend_tail(g.n_lent_slots, chunk_tokens=g.chunk_tokens)
        chunk_buf, ring_slots = split_prompt_buffer(lent.view, g.chunk_bytes, g.ring_slots, blob)
    else:
        assert owned is not None, "an owned prompt geometry needs the prompt.* regions"
        chunk_buf = owned[0][: g.chunk_bytes]
        ring_slots = owned[1][: g.ring_slots * blob].reshape(g.ring_slots, blob)
    refill_trace = ""
    try:
        hook("lent", lent)
        provider.attach_ring(StagingRing(backend, ring_slots))
        provider.counters.reset()
        session.model.transformer.arena_stats = None
        logits = session.prefill(
            fresh, g.chunk_tokens, on_chunk, logits="none", scratch=chunk_buf
        )
    finally:
        provider.attach_ring(None)
    if lent is not None:
        hook("refill", lent)
        refill_trace = cache.refill(lent).trace  # type: ignore[union-attr]
    n_chunks = -(-len(fresh) // g.chunk_tokens)
    return PrefillResult(
        logits, n_chunks, provider.counters, refill_trace, lent.trace if lent else ""
    )
