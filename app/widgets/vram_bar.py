"""VramBar: device memory as one stacked bar by ledger region, with sizes and free bytes."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import flow, fmt_bytes, region_color
from engine.events import Event, LedgerChanged

BLOCK = "█"


def bar_cells(parts: list[tuple[str, int]], capacity: int, width: int) -> list[tuple[str, int]]:
    """Split `width` cells among (name, bytes) parts by largest remainder; every non-empty part
    gets at least one cell when there is room."""
    if capacity <= 0 or width <= 0:
        return []
    exact = [(name, n * width / capacity) for name, n in parts if n > 0]
    cells = [(name, max(1, int(x))) for name, x in exact]
    spare = width - sum(c for _, c in cells)
    order = sorted(range(len(exact)), key=lambda i: exact[i][1] - int(exact[i][1]), reverse=True)
    for i in order[: max(0, spare)]:
        cells[i] = (cells[i][0], cells[i][1] + 1)
    while sum(c for _, c in cells) > width:  # the minimum-one rule overshot: trim the largest
        i = max(range(len(cells)), key=lambda j: cells[j][1])
        cells[i] = (cells[i][0], cells[i][1] - 1)
    return cells


class VramBar(EventView):
    """Stacked bar of `LedgerChanged.regions` + free (+ unaccounted on CUDA), and a legend."""

    TITLE = "VRAM"

    ledger: reactive[LedgerChanged | None] = reactive(None)  # a layout only if the height changes

    def apply_event(self, event: Event) -> None:
        if isinstance(event, LedgerChanged):
            self.ledger = event

    def watch_ledger(self, ledger: LedgerChanged | None) -> None:
        if ledger is not None:
            used = ledger.capacity_bytes - ledger.free_bytes
            self.caption(f"{fmt_bytes(used)} / {fmt_bytes(ledger.capacity_bytes)}")

    def parts(self) -> list[tuple[str, int, int]]:
        """(name, bytes asked for, bytes mapped) per region, then unaccounted and free."""
        ledger = self.ledger
        assert ledger is not None
        parts = [(r.name, r.used_bytes, r.mapped_bytes) for r in ledger.regions]
        if ledger.unaccounted_bytes:
            parts.append(("unaccounted", ledger.unaccounted_bytes, ledger.unaccounted_bytes))
        parts.append(("free", ledger.free_bytes, ledger.free_bytes))
        return parts

    def render(self) -> Text:
        if self.ledger is None:
            return Text("waiting for the memory ledger…", style="dim")
        parts = self.parts()
        width = self.content_width()
        text = Text()
        # the bar is drawn by mapped bytes (whole segments), so it adds up to the capacity
        mapped = [(name, n_mapped) for name, _, n_mapped in parts]
        for name, n in bar_cells(mapped, self.ledger.capacity_bytes, width):
            text.append(BLOCK * n, style=region_color(name))
        text.append("\n")
        legend = []
        for name, n, _ in parts:
            if n > 0:
                legend.append(Text.assemble(("■", region_color(name)), f" {name} {fmt_bytes(n)}"))
        text.append_text(flow(legend, width))
        return text
