"""SegmentMap: one cell per device-memory segment, coloured by the region that owns it."""

from __future__ import annotations

from collections import Counter

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import flow, fmt_bytes, region_color
from engine.trace.events import Event, LedgerChanged

FREE_NAMES = ("", "free")


class SegmentMap(EventView):
    """Draws `LedgerChanged.segment_map` row by row; free segments are dim dots."""

    TITLE = "Segments"

    segments: reactive[tuple[str, ...]] = reactive(())  # a layout only if the height changes
    segment_bytes: reactive[int] = reactive(0)

    def apply_event(self, event: Event) -> None:
        if isinstance(event, LedgerChanged):
            self.segment_bytes = event.segment_bytes
            self.segments = event.segment_map

    def watch_segments(self, segments: tuple[str, ...]) -> None:
        n_free = sum(1 for s in segments if s in FREE_NAMES)
        if segments:
            self.caption(f"{len(segments)} × {fmt_bytes(self.segment_bytes)}, {n_free} free")

    def render(self) -> Text:
        if not self.segments:
            return Text("no segment map yet", style="dim")
        width = self.content_width()
        text = Text()
        for i, owner in enumerate(self.segments):
            if i and i % width == 0:
                text.append("\n")
            if owner in FREE_NAMES:
                text.append("·", style="dim")
            else:
                text.append("■", style=region_color(owner))
        counts = Counter(s for s in self.segments if s not in FREE_NAMES)
        legend = [
            Text.assemble(("■", region_color(name)), f" {name} {n}")
            for name, n in sorted(counts.items(), key=lambda kv: -kv[1])
        ]
        text.append("\n")
        text.append_text(flow(legend, width))
        return text
