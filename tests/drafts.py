"""Test draft sources: the target model drafting for itself (every draft accepted) and an
adversary (none accepted), for the speculative decoder's exactness tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.request.sampler import Sampler
from engine.request.session import Session
from engine.speculative.draft import Draft, draft_token


class TargetDraft:
    """Drafts by decoding ahead with the main model itself, then truncating: every draft is
    the target's own choice (the accept-all reference path)."""

    def resources(self) -> list[Any]:
        return []

    def reusable(self, session: Session, prompt_ids: list[int], reuse: int) -> int:
        return reuse

    def bind(self, session: Session) -> None:
        pass

    def truncate(self, n: int) -> None:
        pass

    def check_integrity(self) -> None:
        pass  # no state of its own

    def observe(self, session: Session, pos0: int, hidden: Any, next_ids: list[int]) -> None:
        pass

    def propose(self, session: Session, pending: int, n_draft: int, sampler: Sampler) -> Draft:
        n0, tok = len(session.tokens), pending
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        try:
            for _ in range(n_draft):
                row = session.backend.download(session.forward([tok]).logits[-1])  # [V]
                tok, q = self._choose(row, sampler)
                tokens.append(tok)
                qs.append(q)  # type: ignore[arg-type]
        finally:
            session.truncate(n0)
        return Draft(tokens, None if sampler.params.greedy else qs)

    def _choose(self, row: np.ndarray, sampler: Sampler) -> tuple[int, np.ndarray | None]:
        return draft_token(row, sampler)


class AdversarialDraft(TargetDraft):
    """Proposes the target's least likely token (one-hot q): greedy accepts none, and with
    top-k or top-p filtering neither does sampling (p(d) = 0)."""

    def _choose(self, row: np.ndarray, sampler: Sampler) -> tuple[int, np.ndarray | None]:
        tok = int(np.argmin(row))
        if sampler.params.greedy:
            return tok, None
        q = np.zeros(row.size, dtype=np.float64)
        q[tok] = 1.0
        return tok, q

