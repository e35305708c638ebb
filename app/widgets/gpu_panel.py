"""GpuPanel: a strip like nvitop's — on CUDA the device as NVML sees it, with its utilisation
and memory over time; on the simulated device the same strip says so, with its capacity."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import flow, fmt_bytes
from app.widgets.spark import spark
from engine.devices import device_traits
from engine.trace.events import Event, GpuStats, LedgerChanged, Ready

MAX_READINGS = 600  # the engine reads NVML every 0.5 s: the last 5 minutes
SPARK_WIDTH = 24
UTIL_STYLE, MEM_STYLE = "#5fd75f", "#5f87d7"


def _opt(v: float | None, unit: str, fmt: str = "{:,.0f}") -> str:
    return "–" if v is None else fmt.format(v) + unit


class GpuPanel(EventView):
    """On CUDA: utilisation and memory used (with sparklines of the readings so far, one every
    0.5 s from the engine's telemetry thread), temperature, power against its limit, SM and
    memory clocks, PCIe link; this process against its limit (`--vram-limit`), the ledger and
    what NVML sees outside it. On the simulated device: 'simulated', its capacity and what the
    ledger maps of it. Hidden until the engine says which device it runs on."""

    TITLE = "GPU"

    DEFAULT_CSS = """
    GpuPanel { display: none; }
    GpuPanel.-live { display: block; }
    """

    stats: reactive[GpuStats | None] = reactive(None)  # a layout only if the height changes
    device: reactive[str] = reactive("")  # Ready.device: "sim" or "cuda:0"
    ledger: reactive[LedgerChanged | None] = reactive(None)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.util: deque[float | None] = deque(maxlen=MAX_READINGS)
        self.used: deque[float] = deque(maxlen=MAX_READINGS)

    @property
    def simulated(self) -> bool:
        return device_traits(self.device).simulated and self.stats is None

    def apply_event(self, event: Event) -> None:
        if isinstance(event, GpuStats):
            s = event.snapshot
            self.util.append(s.gpu_util_pct)
            self.used.append(s.used_bytes)
            self.stats = event
        elif isinstance(event, Ready):
            self.device = event.device
        elif isinstance(event, LedgerChanged):
            self.ledger = event

    def watch_stats(self) -> None:
        self._show()

    def watch_device(self) -> None:
        self._show()

    def _show(self) -> None:
        self.set_class(self.stats is not None or bool(self.device), "-live")
        s = self.stats.snapshot if self.stats is not None else None
        if s is not None:
            self.caption(f"{s.index} · {s.name} · NVML memory {s.memory_api}")
        elif self.simulated:
            self.caption("simulated")
        elif self.device:
            self.caption(self.device)

    def render(self) -> Text:
        if self.stats is not None:
            return self._nvml()
        if self.simulated:
            return self._sim()
        if self.device:
            return Text(f"{self.device}: no NVML reading (the nvidia-ml-py package is not "
                        "installed, or NVML finds no GPU)", style="dim")
        return Text("no device yet", style="dim")

    def _sim(self) -> Text:
        ledger = self.ledger
        text = Text()
        text.append("simulated device", style="bold")
        if ledger is not None:
            cap = ledger.capacity_bytes
            mapped = sum(r.mapped_bytes for r in ledger.regions)
            text.append(f" · capacity {fmt_bytes(cap)} · {fmt_bytes(mapped)} mapped "
                        f"({100 * mapped / max(1, cap):.0f}%)")
        text.append("\nno NVML here: no utilisation, temperature, power or clocks", style="dim")
        return text

    def _nvml(self) -> Text:
        assert self.stats is not None
        s, ledger, limit = self.stats.snapshot, self.stats.ledger_bytes, self.stats.limit_bytes
        width = self.content_width()
        n = max(6, min(SPARK_WIDTH, width // 4))
        util = Text.assemble(("util ", "bold"), spark(list(self.util), n, top=100,
                                                      style=UTIL_STYLE),
                             f" {_opt(s.gpu_util_pct, '%')}")
        mem = Text.assemble(("memory ", "bold"), spark(list(self.used), n, top=s.total_bytes,
                                                       style=MEM_STYLE),
                            f" {fmt_bytes(s.used_bytes)} of {fmt_bytes(s.total_bytes)} "
                            f"({100 * s.used_bytes / max(1, s.total_bytes):.0f}%)")
        power = _opt(s.power_w, " W")
        if s.power_limit_w is not None:
            power += f" of {s.power_limit_w:,.0f} W"
        link = f"PCIe gen {s.pcie_gen} x{s.pcie_width}" if s.pcie_gen else "PCIe –"
        device = [Text(_opt(s.temperature_c, " °C")), Text(power),
                  Text(f"SM {_opt(s.sm_clock_mhz, ' MHz')}"),
                  Text(f"mem {_opt(s.mem_clock_mhz, ' MHz')}"), Text(link)]
        proc = s.process_bytes
        process = "process " + (fmt_bytes(proc) if proc is not None else "–")
        if limit is not None:
            process += f" of {fmt_bytes(limit)}"
        outside = fmt_bytes(max(0, proc - ledger)) if proc is not None else "–"
        this = [Text(process), Text(f"ledger {fmt_bytes(ledger)}"),
                Text(f"outside ledger {outside}")]
        text = flow([util, mem], width, gap=3)
        for items in (device, this):
            text.append("\n")
            text.append_text(flow(items, width, gap=3))
        return text
