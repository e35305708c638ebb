"""Draft sources: where speculative drafts come from. `MTPDraft` runs the model's MTP (nextn)
block, its KV cache following the main session; `DraftSource` is the protocol the decoder asks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.kv import KVCache
from engine.loan.resources import Releasable
from engine.model.mtp import MTPBlock
from engine.request.sampler import Sampler
from engine.request.session import Session, common_prefix

MTP_CHUNK = 2048  # cells per MTP pass when catching up over a prompt (its passes each read the
# whole context's K/V: at 31k tokens 512-cell passes took ~1 s of the first 128 tokens' decode)


@dataclass
class Draft:
    """Proposed tokens, each picked from the draft's logits with the noise of its position
    (`Sampler.sample`): the verifier accepts one when it is the token the target picks."""

    tokens: list[int]


class DraftSource(Protocol):
    """Where drafts come from. Positions are the main session's."""

    def resources(self) -> list[Releasable]: ...

    def check_integrity(self) -> None:
        """Its own state agrees with itself (the draft's KV, its tokens)."""
        ...

    def reusable(self, session: Session, prompt_ids: list[int], reuse: int) -> int:
        """How many of the session's `reuse` matching tokens the source can continue from (as
        it would be once `bind` to `session`). A question: nothing changes, nothing is made."""
        ...

    def bind(self, session: Session) -> None:
        """Follow `session` from now on (a request's begin step; its state may be made here)."""
        ...

    def truncate(self, n: int) -> None:
        """Forget state for positions n.. ."""
        ...

    def observe(self, session: Session, pos0: int, hidden: Any, next_ids: list[int]) -> None:
        """The main model computed positions pos0.. (hidden [T, d] pre-norm); next_ids[i] is
        the token at pos0+i+1 (the last one is the pending token). Replaces state >= pos0."""
        ...

    def propose(self, session: Session, pending: int, n_draft: int, sampler: Sampler) -> Draft:
        """n_draft tokens to follow `pending`; the session is left as it was."""
        ...


class MTPDraft:
    """Drafts with the MTP block; its KV cache (run-state) follows the main session.

    Cell p needs the main hidden h[p]: `observe` builds cells from the prompt's hidden after
    prefill and from the verifier's hidden of each accepted window. Chained drafts write cells
    past the committed ones, fed the block's own output; the next `observe` overwrites them.
    Implements `DraftSource`.
    """

    def __init__(self, block: MTPBlock, kv_alloc: Callable | None = None):
        self.block, self._kv_alloc = block, kv_alloc
        self.kv: KVCache | None = None
        self.n_cells = 0  # committed cells 0..n_cells-1
        self.seq: list[int] = []  # t[0..n_cells]: main tokens and the pending one
        self._logits: np.ndarray | None = None  # [N] draft logits of the last committed cell
        self._hidden: Any = None  # [1, d] block output there: h_prev of the first chained step

    def resources(self) -> list[Releasable]:
        """The releasable objects: MTP experts, then the draft head (loan release order)."""
        return [r for r in (self.block.experts, self.block.head) if hasattr(r, "release")]

    def _follows(self, session: Session) -> bool:
        """Its KV has the session's size and kind (else `bind` makes a new, empty one)."""
        kv = session.kv
        return self.kv is not None and (self.kv.n_ctx, self.kv.kind) == (kv.n_ctx, kv.kind)

    def reusable(self, session: Session, prompt_ids: list[int], reuse: int) -> int:
        if not self._follows(session):
            return 0  # `bind` starts it empty
        n_match = common_prefix(self.seq, prompt_ids)  # cell p stays valid while t[0..p+1] match
        return max(0, min(reuse, self.n_cells, n_match - 1))

    def bind(self, session: Session) -> None:
        """An MTP KV of the session's size and kind, made (from the KV region) on first use."""
        if not self._follows(session):
            kv = session.kv
            self.kv = self.block.new_kv(kv.n_ctx, kv.kind, self._kv_alloc)
            self.n_cells, self.seq, self._logits, self._hidden = 0, [], None, None

    def truncate(self, n: int) -> None:
        if n < self.n_cells:
            self.n_cells = n
            del self.seq[n + 1 :]
            self._logits = self._hidden = None
        if self.kv is not None:
            self.kv.truncate(min(self.kv.n_tokens, self.n_cells))

    def observe(self, session: Session, pos0: int, hidden: Any, next_ids: list[int]) -> None:
        assert self.kv is not None, "bind() makes the MTP KV first (the request's begin)"
        n = len(next_ids)
        assert 0 < n == hidden.shape[0], (n, hidden.shape)
        assert pos0 <= self.n_cells, (
            f"MTP has cells 0..{self.n_cells - 1}, asked to go on at {pos0}"
        )
        assert session.tokens[pos0 + 1 : pos0 + n] == list(next_ids[:-1])
        self.kv.truncate(pos0)
        for a in range(0, n, MTP_CHUNK):
            b = min(n, a + MTP_CHUNK)
            want = "last" if b == n else "none"
            out = self.block.forward(  # prompt rows come from host memory, a slice at a time
                self.block.backend.as_device(hidden[a:b]), np.asarray(next_ids[a:b]), pos0 + a,
                self.kv, want,
            )
        self.n_cells = pos0 + n
        self.seq = [*session.tokens[: pos0 + 1], *next_ids]
        self._logits = self.block.backend.download(out.logits[-1])
        self._hidden = out.hidden[-1:]

    def propose(self, session: Session, pending: int, n_draft: int, sampler: Sampler) -> Draft:
        assert self.kv is not None and self._logits is not None, "observe() comes first"
        assert self.n_cells == len(session.tokens) and self.seq[-1] == pending
        tokens: list[int] = []
        logits, h = self._logits, self._hidden
        for j in range(n_draft):
            if j:  # chained step: the block's own output stands in for the main hidden
                out = self.block.forward(h, np.asarray(tokens[-1:]), self.n_cells + j - 1, self.kv)
                logits, h = self.block.backend.download(out.logits[-1]), out.hidden
            # the pending token sits at n_cells: draft j is the token at n_cells + 1 + j
            tokens.append(sampler.sample(self.block.head.full_logits(logits), self.n_cells + 1 + j))
        return Draft(tokens)

    def check_integrity(self) -> None:
        if self.kv is None:
            return
        self.kv.check_integrity()
        if self.n_cells > self.kv.n_tokens or (self.n_cells and len(self.seq) != self.n_cells + 1):
            raise AssertionError(
                f"MTP state: {self.n_cells} cells, KV {self.kv.n_tokens}, {len(self.seq)} tokens"
            )
