"""SlotMap: the expert cache, one cell per slot: resident, lent, refilling or empty."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from engine.events import CacheChanged, Event

# CacheChanged.states codes -> (glyph, style, label)
STATES = {
    0: ("·", "dim", "empty"),
    1: ("■", "#5faf5f", "resident"),
    2: ("■", "bold #ff8700", "lent"),
    3: ("▪", "bold #ffd75f", "refilling"),
}


class SlotMap(EventView):
    """Draws `CacheChanged.states`; the subtitle names the lent range and how many are lent."""

    DEFAULT_CSS = """
    SlotMap {
        height: auto;
        min-height: 3;
        border: round $primary 50%;
        border-title-color: $text-primary;
        padding: 0 1;
    }
    """

    cache: reactive[CacheChanged | None] = reactive(None, layout=True)

    def on_mount(self) -> None:
        self.border_title = "Expert cache"

    def apply_event(self, event: Event) -> None:
        if isinstance(event, CacheChanged):
            self.cache = event

    def watch_cache(self, cache: CacheChanged | None) -> None:
        if cache is None:
            return
        if cache.lent_range is not None:
            a, b = cache.lent_range
            self.border_subtitle = f"{cache.n_lent} lent [{a}..{b}]"
        else:
            self.border_subtitle = f"{cache.n_lent} lent"

    def counts(self) -> dict[int, int]:
        assert self.cache is not None
        return {code: self.cache.states.count(bytes([code])) for code in STATES}

    def render(self) -> Text:
        if self.cache is None:
            return Text("no expert-cache state yet", style="dim")
        text = Text()
        for code in self.cache.states:
            glyph, style, _ = STATES.get(code, ("?", "red", "unknown"))
            text.append(glyph, style=style)
        text.append("\n")
        counts = self.counts()
        text.append(
            Text("  ").join(
                Text.assemble((f"{STATES[c][0]} ", STATES[c][1]), f"{STATES[c][2]} {counts[c]}")
                for c in STATES
            )
        )
        return text
