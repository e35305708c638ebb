"""The dashboard over time: the session history (samples in event time, one point per request),
its sparklines, the panels naming the request they show, and the GPU strip.

The widgets are fed the engine's real event dataclasses with numbers we choose; the pilot test
runs the real engine (tiny preset) through the app.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.text import Text
from test_app_widgets import MIB, Host, feed, plain
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from app.app import StrataApp
from app.config import ChatConfig
from app.engine_link import EngineLink
from app.scenes import wait_ready, wait_until
from app.store import Store
from app.widgets.base import EventView
from app.widgets.chunk_plan import ChunkPlan
from app.widgets.dashboard import Dashboard
from app.widgets.gpu_panel import GpuPanel
from app.widgets.history import LENT, SessionHistory, memory_by_group, region_group
from app.widgets.history_plots import REQUEST_ROWS, HistoryPlots
from app.widgets.loan_timeline import LoanTimeline
from app.widgets.request_label import RequestLabel
from app.widgets.spark import LEVELS, spark, squeeze
from app.widgets.timing_panel import TimingPanel
from engine.backend.telemetry import GpuSnapshot
from engine.config import EngineOptions, LoanFlags
from engine.trace.events import (
    CacheChanged,
    Event,
    GpuStats,
    LedgerChanged,
    LoanStep,
    PlanChosen,
    PrefillProgress,
    Ready,
    RegionInfo,
    RequestDone,
    RequestStarted,
)

CAPACITY = 64 * MIB
SEGMENT = 2 * MIB


def ledger(t: float, decode_only: bool = True, prompt_mib: int = 4) -> LedgerChanged:
    """A ledger with the loan's regions: decode-only ones present or released, the prompt
    path's chunk buffer at `prompt_mib`."""
    regions = [RegionInfo("weights.dense", 10 * MIB, 5, 10 * MIB),
               RegionInfo("kv", 8 * MIB, 4, 8 * MIB),
               RegionInfo("experts.cache", 20 * MIB, 10, 20 * MIB)]
    if decode_only:
        regions += [RegionInfo("head.native", 4 * MIB, 2, 4 * MIB),
                    RegionInfo("verifier", 2 * MIB, 1, 2 * MIB)]
    regions.append(RegionInfo("prompt.chunk", prompt_mib * MIB, prompt_mib // 2,
                              prompt_mib * MIB))
    used = sum(r.mapped_bytes for r in regions)
    return LedgerChanged(CAPACITY, SEGMENT, tuple(regions), CAPACITY - used,
                         ("free",) * (CAPACITY // SEGMENT), t=t)


def cache(t: float, n_lent: int) -> CacheChanged:
    states = bytes([2] * n_lent + [1] * (16 - n_lent))
    return CacheChanged(states, (16 - n_lent, 15) if n_lent else None, n_lent, t=t)


def request(rid: int, t0: float, fresh: int, prefill_s: float, generated: int,
            decode_s: float, hits: int = 30, misses: int = 10, streamed: int = 0,
            cancelled: bool = False, loan: bool = True) -> list[Event]:
    """One request's events as the engine publishes them (a loan: release, lend, refill,
    restore), `t0` onwards; the prefill ends at t0 + prefill_s."""
    end = t0 + prefill_s
    events: list[Event] = [RequestStarted(rid, fresh + 100, fresh, t=t0)]
    if loan:
        events += [LoanStep("release", "verifier, head", n_bytes=6 * MIB, ms=2.0, t=t0 + 0.01),
                   ledger(t0 + 0.01, decode_only=False, prompt_mib=10)]
    events += [PlanChosen(1024, 8, loan, 2, fresh, t=t0 + 0.02)]
    if loan:
        events += [cache(t0 + 0.03, 4)]
    events += [PrefillProgress(1, 2, fresh // 2, fresh, prefill_s * 500, t=t0 + prefill_s / 2),
               PrefillProgress(2, 2, fresh, fresh, prefill_s * 500, t=end)]
    if loan:
        events += [cache(end + 0.01, 0), ledger(end + 0.02),
                   LoanStep("restore", "verifier, head", n_bytes=6 * MIB, ms=3.0, t=end + 0.02)]
    events.append(RequestDone(fresh + 100, 100, fresh, prefill_s, generated, decode_s,
                              prefill_s + 0.05, decode_hits=hits, decode_misses=misses,
                              bytes_streamed=streamed, cancelled=cancelled,
                              t=end + 0.05 + decode_s))
    return events


def three_requests() -> list[Event]:
    """Ready, the startup ledger and cache, then three requests 10 s apart (idle between)."""
    events: list[Event] = [Ready("tiny", "sim", model_name="tiny", t=99.0), ledger(99.0),
                           cache(99.0, 0)]
    events += request(1, 100.0, 2000, 2.0, 40, 1.0, streamed=300 * MIB)
    events += request(2, 110.0, 6000, 3.0, 64, 2.0, hits=35, misses=5, streamed=900 * MIB)
    events += request(3, 120.0, 200, 0.1, 16, 0.5, hits=40, misses=0, loan=False)
    return events


# -- the history record ------------------------------------------------------------------------
def test_regions_fall_into_the_plotted_groups() -> None:
    assert [region_group(n) for n in ("weights.dense", "kv", "experts.cache", "head.native",
                                      "mtp.experts", "mtp.draft_head", "verifier",
                                      "prompt.chunk", "prompt.ring", "unaccounted", "reserve")
            ] == ["weights", "kv", "experts.cache", "decode-only", "decode-only", "decode-only",
                  "decode-only", "prompt", "prompt", "outside", "other"]
    grouped = memory_by_group(ledger(0.0))
    assert grouped["decode-only"] == 6 * MIB and grouped["prompt"] == 4 * MIB


def test_history_keeps_one_point_per_request_and_the_loan_in_time() -> None:
    h = SessionHistory()
    for e in three_requests():
        h.apply(e)
    assert h.n_requests == 3 and [p.request_id for p in h.requests] == [1, 2, 3]
    assert h.per_request("pp_tok_s") == [1000.0, 2000.0, 2000.0]
    assert h.per_request("tg_tok_s") == [40.0, 32.0, 32.0]
    assert h.per_request("hit_pct") == [75.0, 87.5, 100.0]
    assert h.per_request("bytes_streamed") == [300 * MIB, 900 * MIB, 0]
    decode_only, lent = h.series("decode-only", LENT)
    # each loan shows as samples without the decode-only regions, however short
    assert decode_only.count(0) >= 2 + 3 * 2 - 1, decode_only
    assert max(v for v in lent if v is not None) == 4
    # the idle stretches between requests (~7 s, over MAX_IDLE intervals) are one gap each
    assert decode_only.count(None) == 2, decode_only
    # every interval of a running request has a sample: request 2 ran 3 s = 6 intervals
    assert len([v for v in decode_only if v is not None]) >= 6 + 4 + 1


def test_a_loan_shorter_than_an_interval_still_shows() -> None:
    h = SessionHistory(sample_s=1.0)
    h.apply(ledger(10.0))
    h.apply(RequestStarted(1, 100, 100, t=10.1))
    h.apply(ledger(10.2, decode_only=False, prompt_mib=10))  # released and restored at once
    h.apply(ledger(10.3))
    h.apply(RequestDone(100, 0, 100, 0.1, 1, 0.0, 0.1, t=10.4))
    h.apply(ledger(11.5))  # the next interval closes the first
    decode_only, prompt = h.series("decode-only", "prompt")
    assert decode_only[0] == 0 and prompt[0] == 10 * MIB
    assert decode_only[-1] == 6 * MIB


def test_history_rings_are_bounded() -> None:
    h = SessionHistory(max_samples=10, max_requests=4)
    for i in range(30):
        h.apply(RequestStarted(i + 1, 10, 10, t=float(i)))
        h.apply(ledger(i + 0.2))
        h.apply(RequestDone(10, 0, 10, 0.5, 2, 0.1, 0.5, t=i + 0.6))
    assert len(h.samples) == 10 and len(h.requests) == 4 and h.n_requests == 30
    assert [p.request_id for p in h.requests] == [27, 28, 29, 30]


# -- sparklines --------------------------------------------------------------------------------
def test_spark_draws_levels_gaps_and_squeezes_keeping_spikes() -> None:
    assert spark([0, 4, 8], 10).plain == "▁▄█"
    assert spark([8, None, 8], 10).plain == "█ █"
    assert spark([1, 2], 10, top=100).plain == "▁▁"  # small, never nothing
    values = [5.0] * 50 + [0.0] + [5.0] * 49  # a dip one sample wide
    assert 0.0 in squeeze(values, 10) and len(squeeze(values, 10)) == 10
    assert squeeze([None] * 20, 5) == [None] * 5
    assert spark(list(range(100)), 20).plain[-1] == LEVELS[-1]


# -- the request a panel shows -----------------------------------------------------------------
def test_request_label_in_words() -> None:
    label = RequestLabel()
    assert label.text() == ""
    running = label.after(RequestStarted(12, 5570, 5570))
    assert running.text() == "request 12 · running"
    assert running.left("new conversation") == running  # a running request keeps its name
    done = running.after(RequestDone(5570, 0, 5570, 1.0, 2, 0.1, 1.0))
    assert done.text() == "request 12 · prompt 5,570 tokens"
    assert done.left("new conversation").text() == "new conversation: last request 12"
    stopped = running.after(RequestDone(5570, 0, 5570, 1.0, 0, 0.0, 0.0, cancelled=True))
    assert stopped.text() == "request 12 · prompt 5,570 tokens · cancelled"


def test_timing_panel_names_the_running_request_not_the_last_ones_figures() -> None:
    events = request(11, 100.0, 2000, 2.0, 40, 1.0)
    panel = TimingPanel()

    async def run() -> tuple[str, str, str]:
        app = Host(panel)
        async with app.run_test(size=(80, 20)) as pilot:
            panel.post_message(EngineLink.Events(tuple(events)))
            await pilot.pause()
            finished = panel.border_title
            panel.post_message(EngineLink.Events((
                RequestStarted(12, 6000, 5570, t=130.0),
                PrefillProgress(1, 6, 1024, 5570, 900.0, t=131.0))))
            await pilot.pause()
            return finished, panel.border_title, plain(panel.render(), 80)

    finished, running, text = asyncio.run(run())
    assert finished == "Timing · request 11 · prompt 2,100 tokens"
    assert running == "Timing · request 12 · running"
    assert "6,000 = 430 reused + 5,570 to read" in text
    assert "1,024 of 5,570 tokens · chunk 1 of 6" in text
    assert "(request 11)" in text and "1,000.0 tok/s" in text  # the last one's, named


# -- the GPU strip -----------------------------------------------------------------------------
def test_gpu_strip_says_simulated_with_the_capacity() -> None:
    panel = GpuPanel()
    text = feed(panel, Ready("tiny", "sim"), ledger(1.0), size=(100, 10))
    assert panel.has_class("-live") and panel.border_title == "GPU · simulated"
    assert text.startswith("simulated device")
    assert "capacity 64 MiB · 48 MiB mapped (75%)" in text and "no NVML here" in text


def snapshot(util: int, used_gib: int) -> GpuSnapshot:
    return GpuSnapshot(
        index=0, name="NVIDIA H200", driver_version="580", memory_api="v2",
        total_bytes=140 * 1024 * MIB, used_bytes=used_gib * 1024 * MIB,
        free_bytes=(140 - used_gib) * 1024 * MIB, reserved_bytes=None,
        process_bytes=used_gib * 1024 * MIB, pcie_gen=5, pcie_width=16, pcie_gen_max=5,
        pcie_width_max=16, gpu_util_pct=util, mem_util_pct=20, temperature_c=51,
        power_w=412.0, power_limit_w=700.0, sm_clock_mhz=1980, mem_clock_mhz=3201,
    )  # fmt: skip


def test_gpu_strip_plots_nvml_readings_like_nvitop() -> None:
    panel = GpuPanel()
    readings = [GpuStats(snapshot(u, g), 4 * 1024 * MIB, 8 * 1024 * MIB, t=i * 0.5)
                for i, (u, g) in enumerate([(0, 5), (50, 6), (100, 7)])]
    text = feed(panel, Ready("tiny", "cuda:0"), *readings, size=(100, 10))
    assert panel.border_title == "GPU · 0 · NVIDIA H200 · NVML memory v2"
    assert "util ▁▄█ 100%" in text, text
    assert "7 GiB of 140 GiB (5%)" in text and "412 W of 700 W" in text
    assert "SM 1,980 MHz" in text and "mem 3,201 MHz" in text and "PCIe gen 5 x16" in text
    assert "process 7 GiB of 8 GiB" in text and "outside ledger 3 GiB" in text
    assert len(panel.util) == 3


# -- the history panel -------------------------------------------------------------------------
def test_history_plots_draw_a_row_per_series_and_name_the_requests() -> None:
    plots = HistoryPlots()
    text = feed(plots, *three_requests(), size=(100, 30))
    assert plots.border_title == "History · requests 1–3"
    lines = text.splitlines()
    for label in ("weights", "kv", "experts.cache", "decode-only", "prompt", LENT,
                  *(row[0] for row in REQUEST_ROWS)):
        assert any(line.startswith(label) for line in lines), (label, text)
    pp = next(line for line in lines if line.startswith("PP tok/s"))
    assert "▄▄▄██████" in pp and "2,000" in pp  # 1,000 then 2,000 twice, 3 cells a request
    # the caption names the requests; the line above their rows says how to read them
    assert "per request, oldest left\n" in text
    assert "requests 1–3" not in text


def test_history_plots_say_which_requests_were_cancelled() -> None:
    plots = HistoryPlots()
    events = three_requests()[:3] + request(1, 100.0, 2000, 2.0, 0, 0.0, cancelled=True)
    text = feed(plots, *events, size=(100, 30))
    assert plots.border_title == "History · request 1"
    assert "per request, oldest left, 1 cancelled (yellow)\n" in text


# -- the app, on the real engine ---------------------------------------------------------------
def make_app(tmp_path: Path) -> StrataApp:
    config = ChatConfig(EngineOptions(model="tiny"), LoanFlags(), max_new=8)
    return StrataApp(config, store=Store.open(tmp_path / "conversations.sqlite3"))


def test_three_requests_give_three_points_and_the_panels_name_them(tmp_path: Path) -> None:
    async def run() -> None:
        app = make_app(tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_ready(pilot)
            for n, prompt in enumerate(("hi", "cat", "dog"), start=1):
                await pilot.press(*prompt)
                await pilot.press("enter")
                await wait_until(pilot, lambda n=n: not app.running
                                 and len(app.conv.messages) == 2 * n)
            plots = app.query_one(HistoryPlots)
            await wait_until(pilot, lambda: plots.history.n_requests == 3)
            for _, field, _ in REQUEST_ROWS:
                assert len(plots.history.per_request(field)) == 3, field
            assert [p.request_id for p in plots.history.requests] == [1, 2, 3]
            assert plots.border_title == "History · requests 1–3"
            timing = app.query_one(TimingPanel)
            assert timing.border_title.startswith("Timing · request 3 · prompt ")
            assert app.query_one(ChunkPlan).border_title.startswith("Prompt plan · request 3")
            assert app.query_one(LoanTimeline).border_title.startswith(
                "Loan timeline · request 3")
            gpu = app.query_one(GpuPanel)
            assert gpu.border_title == "GPU · simulated"
            assert plain(gpu.render(), 60).startswith("simulated device")
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert timing.border_title == "Timing · new conversation: last request 3"
            assert app.query_one(ChunkPlan).border_title == (
                "Prompt plan · new conversation: last request 3")
            assert plots.border_title == "History · requests 1–3 · new conversation: " \
                                         "last request 3"

    asyncio.run(run())


# -- the snapshot ------------------------------------------------------------------------------
class DashboardHost(App[None]):
    """The dashboard where the app puts it (2fr beside a 3fr chat pane, left empty here), fed
    three requests' events with chosen numbers (the real engine's timings would change every
    run)."""

    CSS = "#chat-pane { width: 3fr; }"

    def compose(self) -> ComposeResult:
        with Horizontal():
            yield Static(Text("the chat pane: not part of this snapshot", style="dim"),
                         id="chat-pane")
            yield Dashboard()

    def on_mount(self) -> None:
        events = EngineLink.Events(tuple(three_requests()))
        for view in self.query(EventView):  # as the app hands a drained batch to every view
            view.post_message(events)


def test_dashboard_with_sparklines_after_three_requests(snap_compare) -> None:
    assert snap_compare(DashboardHost(), terminal_size=(160, 48))
