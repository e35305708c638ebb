"""Sparklines as text: a series of numbers as one row of block glyphs (▁ to █), squeezed to a
width; a missing value (None: the engine was idle there) is a blank cell."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

LEVELS = "▁▂▃▄▅▆▇█"
GAP = " "


def squeeze(values: Sequence[float | None], width: int) -> list[float | None]:
    """`values` in at most `width` columns: consecutive values grouped evenly, each group drawn
    as the value farthest from the column before it, so a dip or a spike shorter than a column
    (a loan's release, a refill) still shows; a group of only None stays None."""
    n = len(values)
    if n <= width:
        return list(values)
    out: list[float | None] = []
    prev: float | None = None
    for i in range(width):
        group = [v for v in values[i * n // width:(i + 1) * n // width] if v is not None]
        if not group:
            out.append(None)
            continue
        ref = prev if prev is not None else group[0]
        lo, hi = min(group), max(group)
        prev = lo if abs(lo - ref) > abs(hi - ref) else hi
        out.append(prev)
    return out


def spark(values: Sequence[float | None], width: int, top: float | None = None,
          styles: Sequence[str] | None = None, style: str = "") -> Text:
    """One row: each value as a block from 0 to `top` (the largest value by default), the
    newest on the right; a value > 0 never draws as nothing (at least ▁), 0 draws ▁ dim.
    `styles[i]` styles column i (after squeezing only when no squeeze happened)."""
    cols = squeeze(values, max(1, width))
    present = [v for v in cols if v is not None]
    top = top if top is not None else max(present, default=0.0)
    per_column = styles is not None and len(cols) == len(styles)
    text = Text()
    run, run_style = [], ""  # glyphs of one style appended at once: a row is few spans
    for i, v in enumerate(cols):
        if v is None:
            glyph, col_style = GAP, ""
        else:
            level = 0 if top <= 0 else min(len(LEVELS) - 1, int(v / top * len(LEVELS) - 1e-9))
            glyph = LEVELS[max(0, level)]
            col_style = "dim" if v <= 0 else styles[i] if per_column else style  # type: ignore[index]
        if col_style != run_style and run:
            text.append("".join(run), style=run_style)
            run = []
        run.append(glyph)
        run_style = col_style
    if run:
        text.append("".join(run), style=run_style)
    return text
