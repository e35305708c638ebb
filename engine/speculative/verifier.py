"""The verifier: scores a speculative window with one batched forward of the main model.

Its buffers (region `verifier`) are sized once for the largest window: logits [T, V] and
hidden [T, d], float32. They are decode-only scratch, so the VRAM loan releases them before
prefill; `restore()` allocates them again (zeroed, same shapes and bytes), after which a
window scores exactly as before the release.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.model.loader import Model
from engine.request.session import Session

Alloc = Callable[[tuple[int, ...], Any], Any]


class Verifier:
    """Window buffers plus `verify(session, window_ids) -> logits [T, V]`."""

    name = "verifier"

    def __init__(
        self, xp: Any, n_window: int, n_embd: int, n_vocab: int, alloc: Alloc | None = None
    ):
        assert n_window >= 1, n_window
        self.xp = xp
        self.n_window, self.n_embd, self.n_vocab = n_window, n_embd, n_vocab
        self._alloc: Alloc = alloc or (lambda shape, dtype: xp.zeros(shape, dtype=dtype))
        self.nbytes = 4 * n_window * (n_vocab + n_embd)
        self.logits: Any = None  # [T, V]
        self.hidden: Any = None  # [T, d] pre-final-norm, for the MTP block's h_prev
        self.n_last = 0  # rows of the last window
        self.restore()

    @classmethod
    def for_model(
        cls, model: Model, n_window: int, xp: Any = np, alloc: Alloc | None = None
    ) -> Verifier:
        return cls(xp, n_window, model.hp.n_embd, model.hp.n_vocab, alloc)

    @property
    def resident(self) -> bool:
        return self.logits is not None

    def verify(self, session: Session, window_ids: list[int]) -> Any:
        """Append `window_ids` to the session in one forward pass; returns logits [T, V].

        Row j scores the token after window_ids[j]; `hidden[:T]` holds the window's hidden.
        """
        t = len(window_ids)
        assert self.logits is not None, "verifier is released (on loan); restore it first"
        assert 1 <= t <= self.n_window, f"window of {t} tokens > verifier size {self.n_window}"
        res = session.forward(window_ids, logits="all")
        self.logits[:t] = res.logits  # [T, V]
        self.hidden[:t] = res.hidden  # [T, d]
        self.n_last = t
        return self.logits[:t]

    def release(self) -> int:
        """Drop the window buffers; returns the bytes freed (0 if already released)."""
        if self.logits is None:
            return 0
        self.logits = self.hidden = None
        self.n_last = 0
        return self.nbytes

    def restore(self) -> int:
        """Allocate the window buffers again; returns the bytes now resident."""
        if self.logits is None:
            self.logits = self._alloc((self.n_window, self.n_vocab), self.xp.float32)
            self.hidden = self._alloc((self.n_window, self.n_embd), self.xp.float32)
        return self.nbytes

    def check_integrity(self) -> None:
        if self.logits is None:
            if self.hidden is not None:
                raise AssertionError("verifier: logits released but hidden still held")
            return
        shapes = (tuple(self.logits.shape), tuple(self.hidden.shape))
        want = ((self.n_window, self.n_vocab), (self.n_window, self.n_embd))
        held = int(self.logits.nbytes + self.hidden.nbytes)
        if shapes != want or held != self.nbytes:
            raise AssertionError(
                f"verifier buffers {shapes} ({held} bytes), expected {want} ({self.nbytes} bytes)"
            )
        if not 0 <= self.n_last <= self.n_window:
            raise AssertionError(f"verifier last window {self.n_last} outside 0..{self.n_window}")
