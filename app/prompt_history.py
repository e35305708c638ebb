"""PromptHistory: Up/Down through the prompts sent before, as a shell's history.

The entries are the prompts of every conversation, newest first, read from the store on the
first Up (not at start: most sessions never ask). The draft being written when browsing
begins is kept at the bottom; an entry changed while browsing keeps its change until a
message is sent (readline's rule), so nothing typed is lost by moving through the history.
"""

from __future__ import annotations

from collections.abc import Callable

from app.draft import Draft


class PromptHistory:
    """Newest-first prompts and the position of the input among them (-1: the draft)."""

    def __init__(self, load: Callable[[], list[str]] = list) -> None:
        """`load()` returns the stored prompts, newest first (called once, on the first Up)."""
        self._load = load
        self._entries: list[str] | None = None
        self._at = -1
        self._kept: dict[int, Draft] = {}  # position -> what the input held there

    @property
    def browsing(self) -> bool:
        """Whether the input shows an entry of the history (not the draft)."""
        return self._at >= 0

    @property
    def entries(self) -> list[str]:
        if self._entries is None:
            self._entries = self._load()
        return self._entries

    def older(self, current: Draft) -> Draft | str | None:
        """Step back: the entry to show (a Draft when it was changed here before), or None
        at the oldest. `current` is what the input holds now (kept for the way back)."""
        if self._at + 1 >= len(self.entries):
            return None
        return self._step(current, 1)

    def newer(self, current: Draft) -> Draft | str | None:
        """Step forward; the draft at the bottom; None when not browsing."""
        if self._at < 0:
            return None
        return self._step(current, -1)

    def _step(self, current: Draft, step: int) -> Draft | str:
        self._kept[self._at] = current
        self._at += step
        kept = self._kept.get(self._at)
        return kept if kept is not None else self.entries[self._at]

    def sent(self, prompt: str) -> None:
        """A message was sent: it is the newest entry (once), and browsing starts over."""
        self.reset()
        if self._entries is not None and prompt.strip():
            if prompt in self._entries:
                self._entries.remove(prompt)
            self._entries.insert(0, prompt)

    def reset(self) -> None:
        """Forget the position and the changes (the input was replaced by other text)."""
        self._at = -1
        self._kept.clear()
