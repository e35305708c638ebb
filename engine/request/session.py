"""A generation session: one model, one KV cache, the tokens it holds, and the decode loop.

A request's pipeline (`engine.request.record`) adds the reuse rule and speculative decoding on top,
the runtime the VRAM loan and the prompt path; this module is prefill and plain decoding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from engine.backend.base import ExpertProvider
from engine.config import DECODE_ROWS
from engine.errors import StrataError
from engine.experts.provider import DirectExperts
from engine.kv import KVCache
from engine.memory.plan_types import chunk_count
from engine.model.loader import Model
from engine.model.transformer import ForwardResult, PromptChunk
from engine.request.sampler import Sampler
from engine.trace.timing import Timing

# A forward without a prompt chunk of at most this many rows is what `Session.on_step` (the
# cache policy) is told about. Decode steps are at most DECODE_ROWS rows (one token, or a
# `--spec` window); the bound is twice that so that a bare session's short prompt (`generate`'s
# prefill: no PromptChunk) of up to 16 tokens is still counted as before. The serve loop's
# prompts always come with a chunk, so there only decode steps are told.
OBSERVED_ROWS = 2 * DECODE_ROWS


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable(held: list[int], ids: list[int]) -> int:
    """The KV's part of the reuse rule: how many leading tokens of prompt `ids` a KV holding
    `held` keeps: the common prefix, but never all of `ids` (the last prompt token is always
    recomputed, its logits give the first new token). The whole rule, the draft's part too,
    is `engine.request.record.reused_tokens`."""
    return min(common_prefix(held, ids), max(len(ids) - 1, 0))


class StepGraph(Protocol):
    """Decode steps of this session's KV replayed from captured device graphs
    (engine/model/token_graph.py, CUDA)."""

    def handles(self, n_rows: int, experts: ExpertProvider, chunk: PromptChunk | None) -> bool:
        """Whether a forward of `n_rows` rows is a step the graph replays."""
        ...

    def step(self, tokens: np.ndarray, pos0: int, logits: str) -> ForwardResult | None:
        """The step replayed; None where it cannot be (the graph gave up: it said why)."""
        ...

    def release(self) -> None: ...


class Session:
    """Holds the KV cache of one token sequence and runs prefill and decode on it."""

    def __init__(
        self,
        model: Model,
        n_ctx: int = 4096,
        kv_kind: str = "f16",
        experts: ExpertProvider | None = None,
        kv_alloc: Callable | None = None,
    ):
        assert model.transformer is not None, "build the model's weights first"
        self.model, self.backend = model, model.transformer.backend
        self.xp = self.backend.xp
        hp = model.hp
        self.kv = KVCache(self.backend, hp.n_layer, n_ctx, hp.n_head_kv, hp.head_dim, kv_kind,
                          kv_alloc)
        self.experts: ExpertProvider = experts or DirectExperts(model.experts, self.backend)
        self.tokens: list[int] = []  # tokens whose K/V are in the cache, in order
        self.last_hidden: Any = None  # [1, d] pre-norm hidden of the last token (MTP input)
        self.on_hidden: Callable[[int, Any], None] | None = None  # (pos0, hidden [T, d])
        # a decode step's routing, per layer ids [T, k] on the device (`ForwardResult.routes`;
        # the expert cache's admission policy learns from it)
        self.on_step: Callable[[Any], None] | None = None
        self.graph: StepGraph | None = None  # captured decode steps (CUDA), the runtime's

    @property
    def n_ctx(self) -> int:
        return self.kv.n_ctx

    def reset(self) -> None:
        self.tokens = []
        self.kv.truncate(0)
        self.last_hidden = None

    def truncate(self, n: int) -> None:
        """Drop tokens n.. (rejected drafts, or an edited conversation)."""
        if n < len(self.tokens):
            self.last_hidden = None  # it belonged to a dropped token
        del self.tokens[n:]
        self.kv.truncate(n)

    def common_prefix(self, ids: list[int]) -> int:
        return common_prefix(self.tokens, ids)

    def reusable(self, ids: list[int]) -> int:
        """How many leading tokens of prompt `ids` this KV keeps (`reusable`; the request's
        whole rule is `engine.request.record.reused_tokens`)."""
        return reusable(self.tokens, ids)

    def forward(self, ids: list[int], logits: str = "last", chunk: PromptChunk | None = None
                ) -> ForwardResult:
        """Append ids to the sequence in one forward pass (a decode step replayed from the
        captured graph where there is one); returns logits per `logits`. `chunk`: a prompt
        chunk's buffer, clock and stats (the prompt path's)."""
        pos0 = len(self.tokens)
        if pos0 + len(ids) > self.n_ctx:
            raise StrataError(
                f"context full: {pos0 + len(ids)} tokens > --ctx {self.n_ctx}; "
                "start a new conversation or raise --ctx"
            )
        tokens = np.asarray(ids, dtype=np.int64)
        res = None
        if self.graph is not None and self.graph.handles(len(ids), self.experts, chunk):
            res = self.graph.step(tokens, pos0, logits)
            if res is None:  # the graph gave up (it warned): steps run eagerly from now on
                self.graph = None
        if res is None:
            res = self.model.transformer.forward(tokens, pos0, self.kv, self.experts, logits,
                                                 chunk)
        self.tokens.extend(int(t) for t in ids)
        self.last_hidden = res.hidden[-1:].copy()
        if self.on_hidden is not None:
            self.on_hidden(pos0, res.hidden)
        if self.on_step is not None and chunk is None and len(ids) <= OBSERVED_ROWS:
            self.on_step(res.routes)
        return res

    def prefill(
        self,
        ids: list[int],
        chunk_tokens: int,
        on_chunk: Callable[[int, int, float], None] | None = None,
        logits: str = "last",
        chunk: PromptChunk | None = None,
    ) -> Any:
        """Feed ids in chunks of `chunk_tokens`; returns the logits per `logits` ('last':
        the final position's, 'all': every position's, 'none': none — the caller computes
        them from `last_hidden`, e.g. after a loan restored the head)."""
        assert ids, "prefill needs at least one token"
        n_chunks = chunk_count(len(ids), chunk_tokens)
        res = None
        all_logits = []
        for c in range(n_chunks):
            t0 = time.perf_counter()
            part = ids[c * chunk_tokens : (c + 1) * chunk_tokens]
            want = logits if (logits == "all" or c == n_chunks - 1) else "none"
            res = self.forward(part, want, chunk)
            if logits == "all":
                all_logits.append(res.logits)
            if on_chunk:
                on_chunk(c, n_chunks, time.perf_counter() - t0)
        assert res is not None
        return self.xp.concatenate(all_logits) if logits == "all" else res.logits

    def decode(
        self,
        logits: Any,
        sampler: Sampler,
        max_new: int,
        stop_ids: frozenset[int] = frozenset(),
        timing: Timing | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Plain decoding from the prompt's last logits [.., V]: one forward per token, until
        a stop id, `max_new`, a full context or `cancel`."""
        for i in range(max_new):
            tok = sampler.sample(self.backend.download(logits[-1]), len(self.tokens))
            if timing is not None:
                timing.generated += 1
            yield tok
            if (tok in stop_ids or i == max_new - 1 or len(self.tokens) >= self.n_ctx
                    or (cancel is not None and cancel.is_set())):
                return  # the last token's K/V is never needed
            logits = self.forward([tok]).logits
