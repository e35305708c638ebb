"""HistoryPlots: the session so far as sparklines — memory by region group and lent slots in
time, and PP, TG, expert-cache hits, bytes streamed and tokens read per request."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import fmt_bytes, region_color
from app.widgets.history import GROUPS, LENT, SessionHistory
from app.widgets.request_label import RequestLabel
from app.widgets.spark import spark
from engine.trace.events import Event

LABEL_WIDTH = 14
VALUE_WIDTH = 23  # "1.50 GiB · max 2.25 GiB"
REQUEST_CELLS = 3  # cells a request at most (fewer requests than the width)
REQUEST_STYLE = "#87afd7"
GROUP_COLORS = {  # a group takes the colour the VRAM bar gives its main region
    "weights": region_color("weights.dense"),
    "decode-only": region_color("head.native"),
    "prompt": region_color("prompt.chunk"),
    "outside": region_color("unaccounted"),
    LENT: "bold #ff8700",  # the slot map's lent
}


def _rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def _bytes(v: float) -> str:
    return fmt_bytes(v)


def _count(v: float) -> str:
    return f"{v:,.0f}"


def _pct(v: float) -> str:
    return f"{v:.0f}%"


# per-request rows: (label, RequestPoint field, value format)
REQUEST_ROWS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("PP tok/s", "pp_tok_s", _rate),
    ("TG tok/s", "tg_tok_s", _rate),
    ("cache hits", "hit_pct", _pct),
    ("streamed", "bytes_streamed", _bytes),
    ("tokens read", "read_tokens", _count),
)


class HistoryPlots(EventView):
    """Two blocks of sparklines, each row a label, the line (newest right) and the newest
    value with the row's largest: memory by region group (mapped bytes; groups never seen are
    left out) and lent slots, one column per interval of event time (squeezed to the width;
    an idle stretch is a blank column);
    then one column per finished request (a cancelled one drawn yellow, a failed one red). The caption names
    the requests shown and the one running."""

    TITLE = "History"

    DEFAULT_CSS = """
    HistoryPlots {
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    # bumped when the history changed: the history is a mutable ring, the reactive repaints
    version: reactive[int] = reactive(0)
    label: reactive[RequestLabel] = reactive(RequestLabel)

    def __init__(self, history: SessionHistory | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.history = history or SessionHistory(from_first_request=True)

    def apply_event(self, event: Event) -> None:
        if self.history.apply(event):
            self.version += 1
        self.label = self.label.after(event)

    def conversation_changed(self, why: str) -> None:
        """The user left the conversation of the last request (the history stays)."""
        self.label = self.label.left(why)

    def watch_label(self) -> None:
        self._caption()

    def watch_version(self) -> None:
        self._caption()

    def _caption(self) -> None:
        h = self.history
        n = h.n_requests
        first = n - len(h.requests) + 1
        shown = ("no request yet" if not n else "request 1" if n == 1 else
                 f"requests {first}–{n}")
        now = self.label.text()
        self.caption(f"{shown} · {now}" if self.label.running or self.label.left_for else shown)

    _drawn: tuple[tuple[int, int], Text] | None = None  # (version, width) and its drawing

    def render(self) -> Text:
        # the layout check renders too, and batches come 15 times a second during a prefill:
        # a drawing is made once per change of the history or of the width
        key = (self.version, self.content_width())
        if self._drawn is None or self._drawn[0] != key:
            self._drawn = (key, self._draw())
        return self._drawn[1].copy()

    def _draw(self) -> Text:
        h = self.history
        if not h.state and not h.requests:
            return Text("nothing yet: memory and request figures appear as the engine runs",
                        style="dim")
        width = max(4, self.content_width() - LABEL_WIDTH - VALUE_WIDTH - 2)
        text = Text()
        names = (*GROUPS, LENT)
        all_series = dict(zip(names, h.series(*names), strict=True))
        n_samples = len(all_series[LENT])
        per_column = h.sample_s * max(1.0, n_samples / width)
        text.append(f"memory · {n_samples * h.sample_s:,.0f} s of activity, "
                    f"{per_column:.2g} s a column\n", style="dim")
        for group, values in all_series.items():
            present = [v for v in values if v is not None]
            if not any(present):  # never held anything: no row
                continue
            fmt = _count if group == LENT else _bytes
            self._row(text, group, values, width, fmt, GROUP_COLORS.get(group) or
                      region_color(group))
        text.append(self._requests_line(), style="dim")
        if h.requests:
            # a few requests: a few cells each, so three points read as three bars
            k = max(1, min(REQUEST_CELLS, width // len(h.requests)))
            styles = [("red" if p.failed else "yellow" if p.cancelled else REQUEST_STYLE)
                      for p in h.requests for _ in range(k)]
            for label, field, fmt in REQUEST_ROWS:
                text.append("\n")
                values = [v for v in h.per_request(field) for _ in range(k)]
                self._row(text, label, values, width, fmt, REQUEST_STYLE, styles=styles,
                          newline=False)
        return text

    def _requests_line(self) -> str:
        """The line over the per-request rows: how they read (the caption names the requests
        they show), oldest left, and how many were cancelled or failed."""
        h = self.history
        if not h.requests:
            return "per request · none finished yet"
        cancelled = sum(p.cancelled for p in h.requests)
        failed = sum(p.failed for p in h.requests)
        return ("per request, oldest left"
                + (f", {cancelled} cancelled (yellow)" if cancelled else "")
                + (f", {failed} failed (red)" if failed else ""))

    def _row(self, text: Text, label: str, values: list[float | None], width: int,
             fmt: Callable[[float], str], style: str, styles: list[str] | None = None,
             newline: bool = True) -> None:
        present = [v for v in values if v is not None]
        text.append(f"{label[:LABEL_WIDTH - 1]:<{LABEL_WIDTH}}", style=style)
        line = spark(values, width, styles=styles, style=style)
        text.append_text(line)
        text.append(" " * (width - line.cell_len + 1))
        if present:
            newest, top = present[-1], max(present)
            shown = fmt(newest) if newest == top else f"{fmt(newest)} · max {fmt(top)}"
            text.append(shown[:VALUE_WIDTH], style="bold" if newest == top else "")
        if newline:
            text.append("\n")
