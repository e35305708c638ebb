"""Stop strings: generated text ends before the first one (OpenAI's `stop`, `strata run --stop`).

Text streams out as it is generated, so a tail that could still grow into a stop string is
held back until a later piece decides it; the text shown never holds a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Scans streamed text for stop strings; `hit` is the one found (None until then)."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.hit: str | None = None
        self._held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> str:
        """The text that can be shown now: what was held plus `text`, less a tail that may
        begin a stop string; at a stop string, the text before it (and nothing after)."""
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            at, self.hit = min(found, key=lambda f: f[0])
            self._held = ""
            return buf[:at]
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The generation ended: the held tail was no stop string after all."""
        out, self._held = self._held, ""
        return out if self.hit is None else ""

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of `buf` that some stop string begins with."""
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
