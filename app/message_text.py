"""A message's text before it is sent: paste markers as whole units, the tidy text that is
sent, and the line that says a message cannot fit the context.

A long paste stands in the input as a marker `[paste #N: L lines]`. An edit by keyboard that
would cut into a marker takes the whole marker instead (one Backspace removes the chip, one
ctrl+z brings it back); text that looks like a marker but names no paste is never sent as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from engine.errors import ContextFullError, TextTooLongError

# what PastedText.marker writes: a number, and its line count with thousands separators
MARKER = re.compile(r"\[paste #\d+: [\d,]+ lines?\]")
_LEADING_BLANK_LINES = re.compile(r"\A(?:[^\S\n]*\n)+")

Location = tuple[int, int]  # (row, column), as TextArea has them


def marker_spans(line: str) -> list[tuple[int, int]]:
    """The [start, end) columns of every marker on one line (markers never hold a newline)."""
    return [m.span() for m in MARKER.finditer(line)]


def whole_markers(line: Callable[[int], str], start: Location,
                  end: Location) -> tuple[Location, Location]:
    """The range `start`..`end` (either order; `line(row)` gives a row's text) widened so that
    it cuts no marker: an end inside
    a marker moves to the marker's edge, outward. An empty range (an insertion point) inside a
    marker moves to the marker's end, so typed text lands beside the chip, never in it."""
    start, end = sorted((start, end))
    if start == end:
        row, col = start
        for a, b in marker_spans(line(row)):
            if a < col < b:
                return (row, b), (row, b)
        return start, end
    (r0, c0), (r1, c1) = start, end
    for a, b in marker_spans(line(r0)):
        if a < c0 < b:
            c0 = a
    for a, b in marker_spans(line(r1)):
        if a < c1 < b:
            c1 = b
    return (r0, c0), (r1, c1)


def stray_markers(text: str, markers: set[str]) -> list[str]:
    """Marker-shaped text in `text` that names none of the pastes' `markers` (sent as it is,
    it would be 21 literal characters in place of a paste)."""
    return [m.group() for m in MARKER.finditer(text) if m.group() not in markers]


def tidy(text: str) -> str:
    """A message as it is sent: blank lines before and after it, and trailing whitespace,
    dropped; a one-line message stripped of its leading spaces too; the indentation of the
    lines of a longer one kept (code). Empty when the text is only whitespace."""
    text = _LEADING_BLANK_LINES.sub("", text).rstrip()
    return text if "\n" in text else text.lstrip()


def too_long_line(exc: ContextFullError | TextTooLongError) -> str:
    """The app's line for a message that cannot fit --ctx: the numbers, then what to do (the
    app's key for a new conversation named)."""
    if isinstance(exc, TextTooLongError):  # too many bytes to be worth tokenizing
        return f"cannot fit: {exc}"
    if exc.n_message is None:
        return str(exc)
    what = ("start a new conversation (ctrl+n), shorten the message" if exc.fits_alone
            else "shorten the message")
    return f"cannot fit: {exc.numbers}; {what} or restart with a larger --ctx"
