"""SlotMap: the expert cache, one cell per slot: resident, lent, refilling or empty; under a
quant mix, the slot size, each layer range's blob size and the slot bytes left unused."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import flow
from engine.trace.events import CacheChanged, Event

# CacheChanged.states codes -> (glyph, style, label)
STATES = {
    0: ("·", "dim", "empty"),
    1: ("■", "#5faf5f", "resident"),
    2: ("■", "bold #ff8700", "lent"),
    3: ("▪", "bold #ffd75f", "refilling"),
}


class SlotMap(EventView):
    """Draws `CacheChanged.states`; the subtitle names the lent range and how many are lent."""

    TITLE = "Expert cache"

    cache: reactive[CacheChanged | None] = reactive(None)  # a layout only if the height changes

    def apply_event(self, event: Event) -> None:
        if isinstance(event, CacheChanged):
            self.cache = event

    def watch_cache(self, cache: CacheChanged | None) -> None:
        if cache is None:
            return
        if cache.lent_range is not None:
            a, b = cache.lent_range
            self.caption(f"{cache.n_lent} lent [{a}..{b}]")
        else:
            self.caption(f"{cache.n_lent} lent")

    def counts(self) -> dict[int, int]:
        assert self.cache is not None
        return {code: self.cache.states.count(bytes([code])) for code in STATES}

    def render(self) -> Text:
        if self.cache is None:
            return Text("no expert-cache state yet", style="dim")
        width = self.content_width()
        text = Text()
        for i, code in enumerate(self.cache.states):
            if i and i % width == 0:
                text.append("\n")
            glyph, style, _ = STATES.get(code, ("?", "red", "unknown"))
            text.append(glyph, style=style)
        counts = self.counts()
        legend = [
            Text.assemble((STATES[c][0], STATES[c][1]), f" {STATES[c][2]} {counts[c]}")
            for c in STATES
        ]
        text.append("\n")
        text.append_text(flow(legend, width))
        if len(self.cache.blob_sizes) > 1:  # a quant mix: layers' blobs differ in size
            text.append("\n")
            text.append_text(flow(blob_lines(self.cache), width))
        return text


def blob_lines(cache: CacheChanged) -> list[Text]:
    """'slot 127,488 B', each blob size with its layers, the slot bytes left unused."""
    parts = [Text(f"slot {cache.slot_bytes:,} B", style="dim")]
    parts += [Text(f"blob {n:,} B: layers {layers}", style="dim") for n, layers in cache.blob_sizes]
    parts.append(Text(f"{cache.slack_bytes / (1 << 20):.1f} MiB unused", style="dim"))
    return parts
