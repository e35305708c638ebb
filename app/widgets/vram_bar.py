"""VramBar: what the process holds against its limit, as one stacked bar: each ledger region,
what lies outside the ledger, and what is left; a legend with sizes."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import flow, fmt_bytes, region_color
from engine.trace.events import Event, LedgerChanged

BLOCK = "█"
OUTSIDE = "unaccounted"  # the part outside the ledger, as the ledger snapshot names it
LABELS = {OUTSIDE: "outside the ledger"}


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
    """Stacked bar whose total is the process's limit (`LedgerChanged.limit_bytes`: on CUDA
    `--vram-limit`, else the device's capacity): the regions by mapped bytes, what lies outside
    the ledger (on CUDA NVML's process bytes minus the regions: context, cuBLAS, kernels, CuPy's
    pool) and what is left of the limit; a legend; the caption says held / limit, and by how
    much the process passes the limit when it does."""

    TITLE = "VRAM"

    ledger: reactive[LedgerChanged | None] = reactive(None)  # a layout only if the height changes

    def apply_event(self, event: Event) -> None:
        if isinstance(event, LedgerChanged):
            self.ledger = event

    def watch_ledger(self, ledger: LedgerChanged | None) -> None:
        if ledger is not None:
            held, limit = held_bytes(ledger), limit_bytes(ledger)
            over = f" · {fmt_bytes(held - limit)} over the limit" if held > limit else ""
            self.caption(f"{fmt_bytes(held)} / {fmt_bytes(limit)}{over}")

    def parts(self) -> list[tuple[str, int, int]]:
        """(name, bytes asked for, bytes drawn) per region (drawn: whole segments mapped),
        then outside the ledger and what is left of the limit."""
        ledger = self.ledger
        assert ledger is not None
        parts = [(r.name, r.used_bytes, r.mapped_bytes) for r in ledger.regions]
        outside = ledger.unaccounted_bytes or 0
        if outside:
            parts.append((OUTSIDE, outside, outside))
        left = max(0, limit_bytes(ledger) - held_bytes(ledger))
        parts.append(("free", left, left))
        return parts

    def render(self) -> Text:
        if self.ledger is None:
            return Text("waiting for the memory ledger…", style="dim")
        parts = self.parts()
        width = self.content_width()
        text = Text()
        drawn = [(name, n_drawn) for name, _, n_drawn in parts]
        total = max(limit_bytes(self.ledger), held_bytes(self.ledger))
        for name, n in bar_cells(drawn, total, width):
            text.append(BLOCK * n, style=region_color(name))
        text.append("\n")
        legend = []
        for name, n, _ in parts:
            if n > 0:
                label = LABELS.get(name, name)
                legend.append(Text.assemble(("■", region_color(name)), f" {label} {fmt_bytes(n)}"))
        text.append_text(flow(legend, width))
        return text


def limit_bytes(ledger: LedgerChanged) -> int:
    """What the whole process may hold: the event's limit, else the ledger's capacity."""
    return ledger.limit_bytes if ledger.limit_bytes is not None else ledger.capacity_bytes


def held_bytes(ledger: LedgerChanged) -> int:
    """What the process holds: the regions' mapped segments plus what is outside the ledger."""
    return sum(r.mapped_bytes for r in ledger.regions) + (ledger.unaccounted_bytes or 0)
