"""Dashboard: the column of engine pictures beside the chat."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll

from app.widgets.chunk_plan import ChunkPlan
from app.widgets.event_log import EventLog
from app.widgets.flags_panel import FlagsPanel
from app.widgets.gpu_panel import GpuPanel
from app.widgets.history_plots import HistoryPlots
from app.widgets.loan_timeline import LoanTimeline
from app.widgets.segment_map import SegmentMap
from app.widgets.slot_map import SlotMap
from app.widgets.timing_panel import TimingPanel
from app.widgets.vram_bar import VramBar


class Dashboard(VerticalScroll):
    """The GPU strip (NVML on CUDA, 'simulated' on the simulated device), the VRAM bar, the
    session's history plots, segment map, slot map, chunk plan, loan timeline, timing, flags,
    event log."""

    DEFAULT_CSS = """
    Dashboard {
        width: 2fr;
        min-width: 40;
        height: 1fr;
        scrollbar-size-vertical: 1;
        & > EventLog { height: 12; scrollbar-size-vertical: 1; }
    }
    """

    def compose(self) -> ComposeResult:
        yield GpuPanel()
        yield VramBar()
        yield HistoryPlots()
        yield SegmentMap()
        yield SlotMap()
        yield ChunkPlan()
        yield LoanTimeline()
        yield TimingPanel()
        yield FlagsPanel()
        yield EventLog()

    def conversation_changed(self, why: str) -> None:
        """The user left the conversation the last request belongs to (`why`: 'new
        conversation', 'another conversation'): the panels of one request say so."""
        for panel in (ChunkPlan, LoanTimeline, TimingPanel, HistoryPlots):
            self.query_one(panel).conversation_changed(why)
