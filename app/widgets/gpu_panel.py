"""GpuPanel: the device as NVML sees it (CUDA only; hidden until a GpuStats event arrives)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import fmt_bytes
from engine.events import Event, GpuStats


class GpuPanel(EventView):
    """Name, memory used/total (and which NVML memory API), this process against its limit
    (`--vram-limit`), the bytes NVML sees outside the ledger, PCIe link, utilisation,
    temperature and power."""

    TITLE = "GPU"

    DEFAULT_CSS = """
    GpuPanel { display: none; }
    GpuPanel.-live { display: block; }
    """

    stats: reactive[GpuStats | None] = reactive(None)  # a layout only if the height changes

    def apply_event(self, event: Event) -> None:
        if isinstance(event, GpuStats):
            self.stats = event

    def watch_stats(self, stats: GpuStats | None) -> None:
        self.set_class(stats is not None, "-live")
        if stats is not None:
            self.caption(f"{stats.snapshot.name} · NVML memory {stats.snapshot.memory_api}")

    def render(self) -> Table | Text:
        if self.stats is None:
            return Text("no GPU", style="dim")
        s, ledger = self.stats.snapshot, self.stats.ledger_bytes
        table = Table.grid(padding=(0, 2))
        for _ in range(4):
            table.add_column()
        proc, limit = s.process_bytes, self.stats.limit_bytes
        process = fmt_bytes(proc) if proc is not None else "–"
        if limit is not None:
            process += f" of {fmt_bytes(limit)}"
        table.add_row("used", f"{fmt_bytes(s.used_bytes)} of {fmt_bytes(s.total_bytes)}",
                      "process", process)
        outside = fmt_bytes(max(0, proc - ledger)) if proc is not None else "–"
        table.add_row("ledger", fmt_bytes(ledger), "outside ledger", outside)
        link = f"gen {s.pcie_gen} x{s.pcie_width}" if s.pcie_gen else "–"
        util = f"{s.gpu_util_pct}%" if s.gpu_util_pct is not None else "–"
        table.add_row("PCIe", link, "util", util)
        temp = f"{s.temperature_c} °C" if s.temperature_c is not None else "–"
        power = f"{s.power_w:.0f} W" if s.power_w is not None else "–"
        table.add_row("temp", temp, "power", power)
        return table
