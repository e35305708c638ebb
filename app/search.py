"""Searching the history: what a search's words become (an FTS5 query, or LIKE patterns where
the full-text index is missing), and what a hit looks like (a one-line snippet with the matched
words marked). The store runs the queries; this module holds no connection.

Every search is bounded: the first SEARCH_CHARS characters and SEARCH_TERMS words of what was
typed, the newest SEARCH_SCAN matching messages ranked, SEARCH_LIMIT conversations shown. Each
word is quoted, so nothing typed is FTS5 syntax: `NEAR(`, an unbalanced `"`, `AND`, `*` or
`col:` are searched as words and never raise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEARCH_CHARS = 200  # of the query: a paste into the search box is cut here
SEARCH_TERMS = 8
SEARCH_SCAN = 5000  # the newest matching messages ranked: the cost of a word in every message
SEARCH_LIMIT = 200  # conversations shown
SNIPPET_TOKENS = 12  # words of context FTS5 draws around a match
SNIPPET_CHARS = 120  # the same, in characters, where the substring search draws it
# private-use characters around a match in FTS5's snippet: text of ours never holds them
HIT_START, HIT_END = "\ue000", "\ue001"
_ONE_LINE = str.maketrans("\n\r\t\v\f", "     ")  # one character for one: marks stay put
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class SearchHit:
    """A conversation whose messages match: how many do, and its best match as a snippet.

    `message` is the match's position in the conversation's messages as `Store.load` reads
    them; `marks` are the (start, end) of each matched word in `snippet`."""

    conv_id: str
    title: str
    updated: float
    n_hits: int
    message: int
    role: str
    snippet: str
    marks: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Found:
    """A search's hits, newest conversation first. `note` says why the search is a plain
    substring search ("" with the full-text index); `more`: past SEARCH_LIMIT or SEARCH_SCAN,
    hits were left out (a narrower search shows them)."""

    hits: list[SearchHit]
    note: str = ""
    more: bool = False


def search_terms(text: str) -> list[str]:
    """The words searched for: whitespace-separated, bounded in number and length; a lone
    surrogate (a paste) becomes "?" (SQLite takes UTF-8 only), a control character a space
    (FTS5 reads its query up to a NUL: "unterminated string")."""
    text = text[:SEARCH_CHARS].encode("utf-8", "replace").decode("utf-8")
    return _CONTROL.sub(" ", text).split()[:SEARCH_TERMS]


def fts_query(terms: list[str]) -> str:
    """An FTS5 query matching messages holding every term, each term a quoted phrase and,
    from two characters on, a prefix ("quick" finds "quicksort"; "a" finds the word "a": a
    one-letter prefix is most of the index, 8 s over 50,000 messages). "" when no term has a
    letter or digit to index (a phrase without a word would match nothing)."""
    words = [t for t in terms if any(ch.isalnum() for ch in t)]
    return " ".join('"' + t.replace('"', '""') + ('"*' if len(t) > 1 else '"') for t in words)


def like_pattern(term: str) -> str:
    r"""A LIKE pattern (ESCAPE '\') matching `term` anywhere, its % and _ taken literally."""
    escaped = term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def parse_snippet(marked: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """FTS5's snippet (matches between HIT_START and HIT_END) as one line and its marks."""
    text, marks, start = [], [], 0
    n = 0
    for part in re.split(f"([{HIT_START}{HIT_END}])", marked):
        if part == HIT_START:
            start = n
        elif part == HIT_END:
            marks.append((start, n))
        else:
            text.append(part)
            n += len(part)
    return "".join(text).translate(_ONE_LINE), tuple(m for m in marks if m[1] > m[0])


def substring_snippet(content: str, terms: list[str]) -> tuple[str, tuple[tuple[int, int], ...]]:
    """A one-line window of `content` around the first term's first match, every term marked
    (case-insensitively) where it appears in the window."""
    first = re.search(re.escape(terms[0]), content, re.IGNORECASE) if terms else None
    begin = max(0, first.start() - SNIPPET_CHARS // 3) if first else 0
    window = content[begin : begin + SNIPPET_CHARS].translate(_ONE_LINE)
    head = "…" if begin else ""
    tail = "…" if begin + SNIPPET_CHARS < len(content) else ""
    marks = sorted(
        (len(head) + m.start(), len(head) + m.end())
        for t in terms for m in re.finditer(re.escape(t), window, re.IGNORECASE)
    )
    return f"{head}{window}{tail}", tuple(marks)
