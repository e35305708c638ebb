"""Named one-shot fault points: tests arm a step of the loan or the prompt path, and the step
raises there once, so every undo path runs for real."""

from __future__ import annotations

from engine.errors import StrataError


class InjectedFault(StrataError):
    """A failure injected by a test at a named step of the transaction."""


class Faults:
    """Named one-shot fault points: `arm('release:verifier')`, `hit(step)` raises once."""

    def __init__(self) -> None:
        self.armed: set[str] = set()
        self.seen: list[str] = []
        self._after: dict[str, int] = {}  # armed step -> hits that pass before it raises

    def arm(self, step: str, after: int = 0) -> None:
        """`step` raises once, at its first hit after `after` hits that pass (a step hit in a
        loop: `arm('refill:slot', after=2)` fails a refill at its third slot)."""
        self.armed.add(step)
        self._after[step] = after

    def hit(self, step: str) -> None:
        self.seen.append(step)
        if step in self.armed:
            left = self._after.get(step, 0)
            if left:
                self._after[step] = left - 1
                return
            self.armed.discard(step)
            self._after.pop(step, None)
            raise InjectedFault(f"fault injected at {step}")
