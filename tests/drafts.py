"""Test draft sources: the target model drafting for itself (every draft accepted) and an
adversary (none accepted), for the speculative decoder's exactness tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.request.sampler import Sampler
from engine.request.session import Session
from engine.speculative.draft import Draft


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
        try:
            for j in range(n_draft):
                row = session.backend.download(session.forward([tok]).logits[-1])  # [V]
                tok = self._choose(row, sampler, n0 + 1 + j)  # the pending token is at n0
                tokens.append(tok)
        finally:
            session.truncate(n0)
        return Draft(tokens)

    def _choose(self, row: np.ndarray, sampler: Sampler, pos: int) -> int:
        return sampler.sample(row, pos)


class AdversarialDraft(TargetDraft):
    """Proposes the target's least likely token: greedy accepts none, and with top-k or
    top-p filtering neither does sampling (the token is never picked)."""

    def _choose(self, row: np.ndarray, sampler: Sampler, pos: int) -> int:
        return int(np.argmin(row))

