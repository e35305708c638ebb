"""Dashboard widgets fed with the engine's real event dataclasses (unit tests of the widgets).

LedgerChanged, CacheChanged and LoanStep are also drawn from real engine runs in
test_app_flows.py; here each widget is checked against events whose numbers we choose.
"""

from __future__ import annotations

import asyncio
import io
import random
import time

from textual.app import App, ComposeResult
from textual.widget import Widget
from textual.widgets import Markdown, ProgressBar

from app.engine_link import EngineLink, coalesce
from app.widgets.answer_stream import (
    LAYOUT_INTERVAL_S,
    SCROLL_INTERVAL_S,
    SCROLL_STALL_S,
    AnswerStream,
    StreamTail,
    open_block_start,
    wrap_lines,
)
from app.widgets.chat_log import ChatLog
from app.widgets.chunk_plan import ChunkPlan
from app.widgets.event_log import EventLog
from app.widgets.fmt import flow, fmt_bytes
from app.widgets.loan_timeline import LoanTimeline
from app.widgets.segment_map import SegmentMap
from app.widgets.slot_map import SlotMap
from app.widgets.timing_panel import TimingPanel
from app.widgets.vram_bar import BLOCK, VramBar, bar_cells
from engine.trace.events import (
    CacheChanged,
    Event,
    FlagsRefused,
    LedgerChanged,
    LoanStep,
    PlanChosen,
    PrefillProgress,
    RegionInfo,
    RequestDone,
    RequestStarted,
    Token,
    TraceLine,
)

MIB = 1 << 20


class Host(App[None]):
    def __init__(self, widget: Widget) -> None:
        super().__init__()
        self.widget = widget

    def compose(self) -> ComposeResult:
        yield self.widget


def feed(widget: Widget, *events: Event, size: tuple[int, int] = (60, 20)) -> str:
    """Mount `widget`, post the events as one batch, return its rendered text."""

    async def run() -> str:
        app = Host(widget)
        async with app.run_test(size=size) as pilot:
            widget.post_message(EngineLink.Events(tuple(events)))
            await pilot.pause()
            await pilot.pause()
            return plain(widget.render(), size[0])

    return asyncio.run(run())


def plain(renderable: object, width: int) -> str:
    """The text a Rich renderable shows (Text or Table), without styles."""
    from rich.console import Console

    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text().rstrip("\n")


def ledger(unaccounted: int | None = None, limit: int | None = None) -> LedgerChanged:
    regions = (
        RegionInfo("weights.dense", 5 * MIB, 3, 6 * MIB),
        RegionInfo("kv", 8 * MIB, 4, 8 * MIB),
        RegionInfo("experts.cache", 40 * MIB, 20, 40 * MIB),
    )
    return LedgerChanged(
        capacity_bytes=64 * MIB,
        segment_bytes=2 * MIB,
        regions=regions,
        free_bytes=10 * MIB,
        segment_map=("weights.dense",) * 3 + ("kv",) * 4 + ("experts.cache",) * 20 + ("",) * 5,
        unaccounted_bytes=unaccounted,
        limit_bytes=limit,
    )


def test_bar_cells_fill_the_width_in_proportion() -> None:
    cells = bar_cells([("a", 30), ("b", 60), ("c", 1), ("free", 9)], 100, 50)
    assert sum(n for _, n in cells) == 50
    by_name = dict(cells)
    assert by_name["c"] == 1  # tiny regions stay visible
    assert by_name["b"] in (29, 30) and by_name["a"] in (14, 15)
    assert bar_cells([("a", 0)], 100, 10) == []


def test_vram_bar_draws_every_region_and_free() -> None:
    bar = VramBar()
    text = feed(bar, ledger())
    for name, n in (("weights.dense", 5), ("kv", 8), ("experts.cache", 40), ("free", 10)):
        assert f"{name} {fmt_bytes(n * MIB)}" in text
    assert "unaccounted" not in text
    first_line = text.splitlines()[0]
    assert first_line == BLOCK * 58  # the 60-cell host minus the padding
    assert bar.border_title == f"VRAM · {fmt_bytes(54 * MIB)} / {fmt_bytes(64 * MIB)}"


def test_vram_bar_totals_the_limit_and_draws_what_lies_outside_the_ledger() -> None:
    """On CUDA the bar's total is --vram-limit; NVML's bytes outside the ledger (context,
    cuBLAS, kernels, CuPy's pool) are their own labelled part, and free is what is left."""
    bar = VramBar()
    text = feed(bar, ledger(unaccounted=12 * MIB, limit=80 * MIB))
    assert f"outside the ledger {fmt_bytes(12 * MIB)}" in text and "unaccounted" not in text
    assert f"free {fmt_bytes(14 * MIB)}" in text  # 80 - 54 mapped - 12 outside
    assert bar.border_title == f"VRAM · {fmt_bytes(66 * MIB)} / {fmt_bytes(80 * MIB)}"
    assert text.splitlines()[0] == BLOCK * 58  # the whole width is the limit
    parts = {name: drawn for name, _, drawn in bar.parts()}
    assert parts["unaccounted"] == 12 * MIB and sum(parts.values()) == 80 * MIB


def test_vram_bar_says_by_how_much_the_process_passes_its_limit() -> None:
    bar = VramBar()
    text = feed(bar, ledger(unaccounted=20 * MIB, limit=64 * MIB))
    assert "free" not in text
    assert bar.border_title == (f"VRAM · {fmt_bytes(74 * MIB)} / {fmt_bytes(64 * MIB)} · "
                                f"{fmt_bytes(10 * MIB)} over the limit")


def test_segment_map_one_cell_per_segment() -> None:
    widget = SegmentMap()
    text = feed(widget, ledger())
    cells = "".join(text.split("\n")[:-1]) if text.count("\n") > 1 else text.split("\n")[0]
    assert cells.count("■") == 27 and cells.count("·") == 5
    assert "experts.cache 20" in text and "kv 4" in text and "weights.dense 3" in text
    assert widget.border_title == f"Segments · 32 × {fmt_bytes(2 * MIB)}, 5 free"


def test_slot_map_counts_states_and_names_the_lent_range() -> None:
    states = bytes([1] * 10 + [2] * 4 + [3] * 2 + [0] * 4)
    widget = SlotMap()
    text = feed(widget, CacheChanged(states=states, lent_range=(10, 13), n_lent=4))
    assert "resident 10" in text and "lent 4" in text and "refilling 2" in text
    assert "empty 4" in text
    assert widget.border_title == "Expert cache · 4 lent [10..13]"
    assert "blob" not in text  # one blob size: nothing more to say


def test_slot_map_shows_the_blob_sizes_of_a_quant_mix() -> None:
    states = bytes([1] * 16)
    mixed = CacheChanged(states=states, lent_range=None, n_lent=0, slot_bytes=3_059_712,
                         blob_sizes=((2_654_208, "6-7, 9-10"), (3_059_712, "0-5, 8")),
                         slack_bytes=6 * 405_504)
    text = feed(SlotMap(), mixed, size=(80, 12))
    assert "slot 3,059,712 B" in text and "blob 2,654,208 B: layers 6-7, 9-10" in text
    assert "blob 3,059,712 B: layers 0-5, 8" in text and "2.3 MiB unused" in text


def test_loan_timeline_orders_phases_with_their_durations() -> None:
    widget = LoanTimeline()
    t0 = 100.0
    events = (
        RequestStarted(7, 1400, 1400, t=t0 - 0.01),
        LoanStep("release", "verifier, head", n_bytes=12 * MIB, ms=4.0, t=t0),
        LoanStep("plan", "512 / 16", ms=0.5, t=t0 + 0.01),
        PlanChosen(512, 16, True, 3, 1400, t=t0 + 0.02),
        LoanStep("lend", "lent 16 slots", n_bytes=32 * MIB, ms=0.2, t=t0 + 0.03),
        PrefillProgress(1, 3, 512, 1400, 80.0, t=t0 + 0.1),
        LoanStep("refill", "16 slots", n_bytes=32 * MIB, ms=9.0, t=t0 + 0.4),
        LoanStep("restore", "verifier, head", ms=3.0, t=t0 + 0.41),
        RequestDone(1400, 0, 1400, 0.25, 4, 0.02, 0.255, 0, 0, 0, t=t0 + 0.5),
    )
    text = feed(widget, *events, size=(100, 20))
    steps = [line.split()[0] for line in text.splitlines()]
    # the lend arrives after the prefill row opens; it is drawn before it
    assert steps == ["release", "plan", "lend", "prefill", "refill", "restore"]
    assert "250 ms" in text and "9.0 ms" in text and fmt_bytes(12 * MIB) in text
    assert widget.border_title == "Loan timeline · request 7 · prompt 1,400 tokens · loan on"
    # the next request starts a new timeline
    widget2 = LoanTimeline()
    text2 = feed(widget2, *events, PlanChosen(256, 8, False, 1, 20, t=t0 + 1))
    assert [line.split()[0] for line in text2.splitlines()] == ["prefill"]


def test_chunk_plan_shows_the_plan_and_moves_the_bar() -> None:
    widget = ChunkPlan()

    async def run() -> None:
        app = Host(widget)
        async with app.run_test(size=(80, 20)) as pilot:
            widget.post_message(
                EngineLink.Events(
                    (
                        PlanChosen(2304, 227, True, 4, 9000, reasons=("lends 40 slots",)),
                        PrefillProgress(2, 4, 4608, 9000, 310.0),
                    )
                )
            )
            await pilot.pause()
            text = str(widget.query_one("#plan-text").render())
            assert "2,304 / 227" in text and "loan on" in text
            assert "chunk 2 of 4" in text and "4,608 of 9,000 tokens" in text
            assert "lends 40 slots" in text
            bar = widget.query_one(ProgressBar)
            assert (bar.total, bar.progress) == (9000, 4608)

    asyncio.run(run())


def test_timing_panel_rates() -> None:
    done = RequestDone(2000, 500, 1500, 1.0, 40, 2.0, 1.1, 30, 21, 5 * MIB)
    text = feed(TimingPanel(), done, size=(100, 20))
    assert "1,500.0 tok/s" in text and "20.0 tok/s" in text  # PP and TG
    assert "21 of 30 (70%)" in text and fmt_bytes(5 * MIB) in text
    assert "2,000 = 500 reused + 1,500" in text
    assert "steps" not in text  # plain decoding: no drafting policy to report
    spec = RequestDone(2000, 500, 1500, 1.0, 40, 2.0, 1.1, 30, 0, 5 * MIB,
                       spec_steps=40, drafted_steps=10)
    shown = feed(TimingPanel(), spec, size=(100, 20))
    assert "0 of 30 (0%)" in shown and "10/40 steps" in shown


def test_timing_panel_gives_each_fact_one_line_in_the_dashboard_at_120_columns() -> None:
    done = RequestDone(7099, 0, 7099, 2.345, 64, 0.41, 2.4, 30, 21, 523 * MIB,
                       spec_steps=40, drafted_steps=10)
    lines = feed(TimingPanel(), done, size=(47, 20)).splitlines()  # the pane at 120 columns
    labels = [line.split()[0] for line in lines]
    assert labels == ["PP", "TG", "TTFT", "prompt", "drafts", "streamed"], lines
    assert "7,099 = 0 reused + 7,099 read" in lines[3] and "10/40 steps" in lines[4]


def test_event_log_writes_trace_lines_and_refusals() -> None:
    log = EventLog()

    async def run() -> list[str]:
        app = Host(log)
        async with app.run_test(size=(100, 20)) as pilot:
            log.post_message(
                EngineLink.Events(
                    (
                        TraceLine("strata serve: prompt plan 512 / 8"),
                        Token("ignored"),
                        FlagsRefused(("needs --serve",)),
                    )
                )
            )
            await pilot.pause()
            return [line.text for line in log.lines]

    lines = asyncio.run(run())
    assert lines == ["strata serve: prompt plan 512 / 8", "flags refused: needs --serve"]


def log_lines(
    log: EventLog, *events: Event, size: tuple[int, int], resize_to: int = 0
) -> tuple[list[str], int]:
    """Post `events` to a mounted EventLog; its lines (after a resize to `resize_to` columns)
    and the width they have to fit."""

    async def run() -> tuple[list[str], int]:
        app = Host(log)
        async with app.run_test(size=size) as pilot:
            log.post_message(EngineLink.Events(tuple(events)))
            await pilot.pause()
            if resize_to:
                await pilot.resize_terminal(resize_to, size[1])
                await pilot.pause()
                await pilot.pause()
            lines = [line.text.rstrip() for line in log.lines]
            return lines, log.scrollable_content_region.width

    return asyncio.run(run())


def test_event_log_wraps_lines_to_the_pane_width() -> None:
    words = " ".join(f"word{i:02d}" for i in range(30))  # 209 characters
    lines, width = log_lines(EventLog(), TraceLine(words), size=(40, 20))
    assert 30 < width < 40
    assert all(len(line) <= width for line in lines), "a line is wider than the pane"
    assert " ".join(lines) == words, "text was clipped"
    again, wider = log_lines(EventLog(), TraceLine(words), size=(40, 20), resize_to=100)
    assert wider > 90 and len(again) < len(lines), "not laid out again for the wider pane"
    assert all(len(line) <= wider for line in again) and " ".join(again) == words


def test_event_log_shows_a_loan_step_once() -> None:
    line = "strata loan: released verifier 4.00 MiB, head 8.00 MiB in 1.5 ms"
    events = (
        LoanStep("release", line.removeprefix("strata loan: "), n_bytes=12 * MIB, ms=1.5),
        TraceLine(line),
        TraceLine("strata serve: prompt plan 512 / 8 (chunk tokens / ring slots), loan on"),
    )
    lines, _ = log_lines(EventLog(), *events, size=(120, 20))
    assert lines == [line, events[2].text]


def test_coalesce_keeps_the_newest_snapshot_and_merges_tokens() -> None:
    events = [
        PrefillProgress(1, 3, 10, 30, 1.0),
        Token("a"),
        Token("b"),
        TraceLine("x"),
        PrefillProgress(2, 3, 20, 30, 1.0),
        Token("c"),
    ]
    out = coalesce(events)
    assert [type(e).__name__ for e in out] == ["Token", "TraceLine", "PrefillProgress", "Token"]
    assert out[0].text == "ab" and out[2].chunk == 2 and out[3].text == "c"


def test_flow_never_splits_an_item() -> None:
    from rich.text import Text

    items = [Text("alpha 1"), Text("beta 22"), Text("gamma 333")]
    lines = flow(items, 16).plain.split("\n")
    assert lines == ["alpha 1  beta 22", "gamma 333"]


def test_gpu_panel_appears_with_nvml_readings() -> None:
    from app.widgets.gpu_panel import GpuPanel
    from engine.backend.telemetry import GpuSnapshot
    from engine.trace.events import GpuStats

    snap = GpuSnapshot(
        index=0, name="NVIDIA H200", driver_version="580", memory_api="v2",
        total_bytes=140 * 1024 * MIB, used_bytes=6 * 1024 * MIB, free_bytes=134 * 1024 * MIB,
        reserved_bytes=None, process_bytes=5 * 1024 * MIB, pcie_gen=5, pcie_width=16,
        pcie_gen_max=5, pcie_width_max=16, gpu_util_pct=87, mem_util_pct=40,
        temperature_c=51, power_w=412.0,
    )
    panel = GpuPanel()
    assert not panel.has_class("-live")
    text = feed(panel, GpuStats(snap, 4 * 1024 * MIB, 8 * 1024 * MIB), size=(80, 20))
    assert panel.has_class("-live")
    assert f"outside ledger {fmt_bytes(1024 * MIB)}" in text  # process - ledger
    assert f"{fmt_bytes(5 * 1024 * MIB)} of {fmt_bytes(8 * 1024 * MIB)}" in text  # of the limit
    assert "gen 5 x16" in text and "87%" in text and "412 W" in text


def test_wrap_lines_grows_like_a_full_wrap() -> None:
    """Appending never changes a line before the open one: the tail wraps only that line."""
    rng = random.Random(7)
    words = ["a", "bb", "expert", "cache", "x" * 25, "é", "日本語", " ", "\n", "\n\n"]
    for _ in range(400):
        text = "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(0, 40)))
        width = rng.randint(1, 30)
        whole, _ = wrap_lines(text, width)
        lines: list[str] = []
        start = 0
        for end in sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 8))) + [len(text)]:
            grown, last = wrap_lines(text[start:end], width)
            lines = lines[:-1] + grown if lines else grown
            start += last
        assert lines == whole, (text, width)
        assert all(len(line) <= width or len(line.strip()) == 1 for line in whole)
        assert "".join(whole).replace(" ", "") == text.replace(" ", "").replace("\n", "")


def test_open_block_start_finds_the_block_being_written() -> None:
    from markdown_it import MarkdownIt

    parser = MarkdownIt("gfm-like")
    assert open_block_start("one paragraph, still open", parser) == 0
    text = "# Title\n\nA paragraph.\n\n- a list"
    assert text[open_block_start(text, parser) :] == "- a list"
    fence = "Intro.\n\n```py\nx = 1\n\ny = 2\n"  # an open fence holds its blank lines
    assert fence[open_block_start(fence, parser) :] == "```py\nx = 1\n\ny = 2\n"


class StreamHost(App[None]):
    def compose(self) -> ComposeResult:
        yield Markdown()
        yield StreamTail()


def test_answer_stream_draws_finished_blocks_as_markdown() -> None:
    async def run() -> None:
        app = StreamHost()
        async with app.run_test(size=(40, 20)) as pilot:
            markdown, tail = app.query_one(Markdown), app.query_one(StreamTail)
            stream = AnswerStream(markdown, tail)
            second = "Second block, a long one that wraps at the width"
            for piece in ("Some **bold", "** text.", "\n\nSecond ", second[7:]):
                await stream.write(piece)
                await pilot.pause()
            assert markdown.source == "Some **bold** text.\n\n"
            assert tail.text == second
            await pilot.pause(LAYOUT_INTERVAL_S)
            shown = [tail.render_line(y).text.rstrip() for y in range(tail.size.height)]
            assert shown == ["Second block, a long one that wraps at", "the width"]  # 38 cells
            await stream.stop()
            assert markdown.source == f"Some **bold** text.\n\n{second}"
            assert tail.text == "" and tail.n_lines == 0

    asyncio.run(run())


def test_stream_tail_status_gives_its_line_to_the_first_text_without_a_layout() -> None:
    async def run() -> None:
        app = StreamHost()
        async with app.run_test(size=(40, 20)) as pilot:
            tail = app.query_one(StreamTail)
            tail.reserve(5)  # what the chat keeps below the prompt
            tail.show_status("reading the prompt: 512 of 4,096 tokens")
            await pilot.pause()
            assert tail.render_line(0).text.strip() == "reading the prompt: 512 of 4,096 toke…"
            layouts: list[object] = []
            app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
            tail.show_status("reading the prompt: 1,024 of 4,096 tokens")
            for word in ("Hello", " there,", " a second", " line comes", " when this wraps."):
                tail.append(word)
                await pilot.pause()
            assert layouts == [], "the text grew inside the lines kept for it"
            shown = [tail.render_line(y).text.rstrip() for y in range(3)]
            assert shown == ["Hello there, a second line comes when", "this wraps.", ""]

    asyncio.run(run())


def test_streaming_an_answer_lays_out_a_few_times_a_second() -> None:
    """Each layout reflows the whole screen (the dashboard too); a streamed answer asks for one
    at most every LAYOUT_INTERVAL_S, however many lines it grows by meanwhile."""
    n_appends = 60

    async def run() -> tuple[int, float, str]:
        app = Host(ChatLog())
        async with app.run_test(size=(80, 30)) as pilot:
            layouts: list[object] = []
            app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
            chat = app.query_one(ChatLog)
            await chat.begin_exchange("hello")
            await pilot.pause()
            layouts.clear()
            t0 = time.monotonic()
            for i in range(n_appends):  # about a line each
                await chat.append(f" token{i:02d} and some more words for the line ({i})")
                await pilot.pause()
            elapsed = time.monotonic() - t0
            n_layouts = len(layouts)
            await chat.finish("".join(f" token{i:02d} and some more words for the line ({i})"
                                      for i in range(n_appends)))
            await pilot.pause()
            answer = chat.query_one("MessageView.-assistant Markdown", Markdown).source
            return n_layouts, elapsed, answer

    n_layouts, elapsed, answer = asyncio.run(run())
    assert "token59" in answer
    # a layout pass may be followed by one more (Textual settles sizes in a second pass)
    assert n_layouts <= 2 * (elapsed / LAYOUT_INTERVAL_S + 2), (n_layouts, elapsed)
    assert n_layouts < n_appends / 2, (n_layouts, elapsed)


def test_a_dashboard_picture_lays_out_only_when_its_height_changes() -> None:
    """A layout reflows the whole screen; a loan sends ledger and cache snapshots 15 times a
    second, which change the pictures but rarely their height."""
    bar = VramBar()

    async def run() -> list[int]:
        app = Host(bar)
        async with app.run_test(size=(60, 20)) as pilot:
            layouts: list[object] = []
            app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
            counts = []
            for free_mib in (10, 9, 8, 7):  # same regions, other sizes: same height
                snapshot = ledger()
                snapshot = LedgerChanged(snapshot.capacity_bytes, snapshot.segment_bytes,
                                         snapshot.regions, free_mib * MIB, snapshot.segment_map)
                bar.post_message(EngineLink.Events((snapshot,)))
                await pilot.pause()
                await pilot.pause()
                counts.append(len(layouts))
            return counts

    counts = asyncio.run(run())
    assert counts[0] >= 1, "the first snapshot gives the bar its height"
    assert counts[-1] == counts[0], f"layouts after each snapshot: {counts}"


def test_event_log_lines_lay_the_screen_out_only_when_its_scrollbar_appears() -> None:
    """A layout reflows the whole screen; a line written to the log changes only its scrollbar,
    so the log asks for one when the scrollbar first shows, and then repaints."""
    log = EventLog()

    async def run() -> tuple[list[int], bool, float, float]:
        app = Host(log)
        async with app.run_test(size=(60, 12)) as pilot:
            await pilot.pause()
            layouts: list[object] = []
            app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
            counts = []
            for i in range(30):
                log.post_message(EngineLink.Events((TraceLine(f"strata lend: line {i}"),)))
                await pilot.pause()
                await pilot.pause()
                counts.append(len(layouts))
            bar = log.vertical_scrollbar
            return counts, log.show_vertical_scrollbar, log.scroll_y, bar.window_virtual_size

    counts, shown, scroll_y, virtual = asyncio.run(run())
    assert shown, "30 lines overflow a 12-line screen"
    assert counts[-1] == counts[0] + 1 or counts[-1] <= 2, f"layouts after each line: {counts}"
    assert counts[-1] <= 3, f"layouts after each line: {counts}"
    assert virtual == 30, "the scrollbar knows the new height"
    assert scroll_y > 0, "the log follows its newest line"


def test_a_dashboard_picture_keeps_its_height_while_an_answer_streams() -> None:
    """The legend of the VRAM bar loses a row when a region goes (the MTP experts lent during a
    decode); while an answer streams the picture keeps its height (no layout) and gives the
    lines back when the answer ends."""
    bar = VramBar()
    full = ledger()
    extra = (RegionInfo("head.native", 4 * MIB, 2, 4 * MIB),
             RegionInfo("verifier", 2 * MIB, 1, 2 * MIB),
             RegionInfo("mtp.experts", 3 * MIB, 2, 3 * MIB))
    tall = LedgerChanged(full.capacity_bytes, full.segment_bytes, full.regions + extra,
                         full.free_bytes, full.segment_map)

    async def run() -> list[tuple[int, int]]:
        app = Host(bar)
        async with app.run_test(size=(40, 20)) as pilot:
            seen = []
            for snapshot, streaming in ((tall, False), (tall, True), (full, True),
                                        (tall, True), (full, True), (full, False)):
                layouts: list[object] = []
                app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
                bar.post_message(EngineLink.Events((snapshot,), streaming))
                await pilot.pause()
                await pilot.pause()
                seen.append((bar.size.height, len(layouts)))
            return seen

    seen = asyncio.run(run())
    tall_h = seen[0][0]
    assert [h for h, _ in seen[1:5]] == [tall_h] * 4, seen
    assert [n for _, n in seen[1:5]] == [0] * 4, f"layouts while streaming: {seen}"
    assert seen[5][0] < tall_h and seen[5][1] >= 1, "the answer ended: the legend shrinks"


def test_an_answer_that_outgrows_the_view_scrolls_its_top_away_in_one_layout() -> None:
    """Past the view kept below the prompt, one layout takes a view more, so the answer's top
    leaves the view and the tail follows its last lines (scrolling itself, no layout), not a
    layout every LAYOUT_INTERVAL_S until the prompt above has scrolled away."""

    async def run() -> tuple[bool, int, bool, str]:
        app = Host(ChatLog())
        async with app.run_test(size=(60, 16)) as pilot:
            chat = app.query_one(ChatLog)
            await chat.begin_exchange("hello")
            await pilot.pause()
            await pilot.pause()
            tail = chat.query_one(StreamTail)
            i = 0

            async def line() -> None:
                nonlocal i
                await chat.append(f" line{i:02d} " + "word " * 9)
                i += 1
                await pilot.pause()

            while tail.n_lines <= tail.size.height:  # fill the view kept for the answer
                await line()
            await pilot.pause(LAYOUT_INTERVAL_S)  # the layout that takes the lines is due
            await line()  # it comes with this one
            await pilot.pause()
            top_hidden = app.screen.find_widget(tail).region.y < chat.region.y
            layouts: list[object] = []
            app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
            for _ in range(20):  # more lines than the view: the tail follows them
                await line()
            await pilot.pause(SCROLL_INTERVAL_S + SCROLL_STALL_S)  # it scrolls on a timer
            last = f"line{i - 1:02d}"
            bottom = [tail.render_line(y).text for y in range(tail.size.height)]
            shown = any(last in text for text in bottom)
            return top_hidden, len(layouts), shown, "\n".join(bottom[-3:])

    top_hidden, n_layouts, shown, bottom = asyncio.run(run())
    assert top_hidden, "one layout scrolled the answer's top out of view"
    assert n_layouts == 0, f"{n_layouts} layouts while the tail followed 20 lines"
    assert shown, f"the last line is drawn at the bottom:\n{bottom}"


def test_a_dashboard_picture_is_measured_at_the_width_it_gets() -> None:
    """A layout that gives a picture a new width measures its height from a drawing at that
    width (`EventView.content_width` while measuring), not the old one: no blank line left
    under it, none of it cut."""
    bar = VramBar()

    async def run() -> tuple[int, int, int]:
        app = Host(bar)
        async with app.run_test(size=(100, 30)) as pilot:
            bar.post_message(EngineLink.Events((ledger(),)))
            await pilot.pause()
            await pilot.pause()
            wide = bar.size.height
            await pilot.resize_terminal(30, 30)
            await pilot.pause()
            await pilot.pause()
            drawn = len(plain(bar.render(), bar.content_size.width).splitlines())
            return wide, bar.content_size.height, drawn

    wide, height, drawn = asyncio.run(run())
    assert height > wide - bar.styles.gutter.height, "the legend wraps at 30 columns"
    assert height == drawn, f"laid out {height} lines for a drawing of {drawn}"
