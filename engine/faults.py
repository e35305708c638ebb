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

    def arm(self, step: str) -> None:
        self.armed.add(step)

    def hit(self, step: str) -> None:
        self.seen.append(step)
        if step in self.armed:
            self.armed.discard(step)
            raise InjectedFault(f"fault injected at {step}")
