"""Number formats and region colours shared by the dashboard widgets."""

from __future__ import annotations

from rich.text import Text

REGION_COLORS = {
    "weights.dense": "#5f87d7",
    "kv": "#af87d7",
    "experts.cache": "#5faf5f",
    "head.native": "#d7af5f",
    "mtp.experts": "#d787af",
    "mtp.draft_head": "#d75f87",
    "verifier": "#d7875f",
    "prompt.chunk": "#00afaf",
    "prompt.ring": "#5fd7d7",
    "reserve": "#808080",
    "unaccounted": "#af5f5f",
    "free": "#3a3a3a",
}
OTHER_COLOR = "#c0c0c0"


def region_color(name: str) -> str:
    return REGION_COLORS.get(name, OTHER_COLOR)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_ms(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 10_000 else f"{ms:,.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def rate(count: int, ms: float) -> str:
    return f"{count / (ms / 1e3):,.1f} tok/s" if ms > 0 else "–"


def flow(items: list[Text], width: int, gap: int = 2) -> Text:
    """Lay legend items out in lines of at most `width` cells, never breaking an item."""
    out, line_len = Text(), 0
    for item in items:
        n = item.cell_len
        if line_len and line_len + gap + n > width:
            out.append("\n")
            line_len = 0
        elif line_len:
            out.append(" " * gap)
            line_len += gap
        out.append_text(item)
        line_len += n
    return out
