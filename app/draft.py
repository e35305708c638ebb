"""Draft: what the prompt input held when a message was sent (its text and collapsed pastes),
so a cancel can put it back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Draft:
    """What the prompt input held when a message was sent, to put back on cancel."""

    text: str
    pastes: tuple[tuple[int, str], ...] = ()
