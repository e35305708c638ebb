"""`python -m app.bench_resize`: what a terminal resize costs the app's UI thread with a long
history open, as a table.

The app runs headless on the `tiny` preset with a conversation of `--exchanges` questions and
multi-paragraph Markdown answers (headings, lists, code, a table, a quote), scrolled to its end.
Each resize is posted as a terminal's (a Resize to the app); the bench then sleeps (no
pilot.pause: that posts a message to every widget, as costly as what is measured) for WINDOW_S.
A resize's cost is the UI thread's CPU time (`time.thread_time`) over that window, less an idle
window's; with it, the screen's layout refreshes in the window, the garbage collector's
generation-2 passes (the Python heap holds some 280 objects a widget) and how many messages
were laid out whole (`ChatLog.laid_out`; the others are folded).

    python -m app.bench_resize [--exchanges 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from textual.events import Resize
from textual.geometry import Size

from app.app import StrataApp
from app.config import ChatConfig
from app.scenes import wait_ready
from app.store import Store
from app.widgets.chat_log import ChatLog
from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation, Message

START = (120, 40)
SIZES = ((80, 24), (160, 48), (100, 30), (120, 40))
WINDOW_S = 2.5  # a resize's layouts are over well within this on a 2-core VM
PARAGRAPH = ("The expert cache holds the quantized blobs of the experts the profile ranks "
             "first; a prompt lends its tail to the staging ring and refills it after the "
             "last chunk, so decoding finds every slot where it left it. ")


def answer(i: int) -> str:
    """A multi-paragraph Markdown answer (about 60 lines at 70 columns)."""
    return (f"## Answer {i}\n\n{PARAGRAPH * 3}\n\n{PARAGRAPH * 2}\n\n- the first point, with "
            f"`code` and **bold** text that wraps\n- the second point\n- the third point, "
            f"{PARAGRAPH}\n\n```python\ndef f(x):\n    return x + {i}\n```\n\n{PARAGRAPH * 4}"
            f"\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n> a quote: {PARAGRAPH}")


def history(n_exchanges: int) -> Conversation:
    conv = Conversation()
    for i in range(n_exchanges):
        conv.messages.append(Message("user", f"question {i}: tell me about the loan"))
        conv.messages.append(Message("assistant", answer(i)))
    return conv


@dataclass(frozen=True)
class Sample:
    """One resize: the UI thread's CPU, the layout refreshes, the generation-2 collections
    (ms), the messages laid out whole after it."""

    size: tuple[int, int]
    ui_ms: float
    refreshes: int
    gc2_ms: float
    laid_out: int


class GcTimes:
    """Wall time of each generation-2 collection while installed (gc.callbacks)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.times.append(time.perf_counter() - self._started)


async def cpu_over(window_s: float) -> float:
    """The UI thread's CPU seconds over `window_s` of sleeping (the app runs meanwhile)."""
    started = time.thread_time()
    await asyncio.sleep(window_s)
    return time.thread_time() - started


async def measure(n_exchanges: int, rounds: int) -> tuple[list[Sample], int, int]:
    """Resize through SIZES `rounds` times; the samples, the messages and the chat's widgets."""
    with tempfile.TemporaryDirectory() as data:
        store = Store.open(Path(data) / "conversations.sqlite3")
        app = StrataApp(ChatConfig(EngineOptions(model="tiny"), LoanFlags()), store=store,
                        export_dir=Path(data) / "exports")
        samples: list[Sample] = []
        gc_times = GcTimes()
        async with app.run_test(size=START) as pilot:
            await wait_ready(pilot)
            chat = app.query_one(ChatLog)
            app.conv = history(n_exchanges)
            await chat.show(app.conv)
            await asyncio.sleep(3 * WINDOW_S)  # laid out, folded, idle
            n_widgets = len(chat.query("*"))
            refreshes = [0]
            app.screen.screen_layout_refresh_signal.subscribe(
                app.screen, lambda _: refreshes.__setitem__(0, refreshes[0] + 1),
                immediate=True)
            idle = await cpu_over(WINDOW_S)
            gc.callbacks.append(gc_times)
            try:
                for _ in range(rounds):
                    for w, h in SIZES:
                        refreshes[0] = 0
                        gc_times.times.clear()
                        app.post_message(Resize(Size(w, h), Size(w, h)))
                        cpu = await cpu_over(WINDOW_S)
                        samples.append(Sample((w, h), (cpu - idle) * 1000, refreshes[0],
                                              sum(gc_times.times) * 1000,
                                              len(chat.laid_out)))
            finally:
                gc.callbacks.remove(gc_times)
        return samples, len(app.conv.messages), n_widgets


def table(samples: list[Sample], n_messages: int, n_widgets: int) -> str:
    lines = [f"{n_messages} messages, {n_widgets:,} widgets in the chat",
             ("| resize to | UI thread ms, median (range) | of it gen-2 GC ms, median | "
              "layout refreshes | messages laid out |"),
             "|---|---:|---:|---:|---:|"]
    for size in SIZES:
        of = [s for s in samples if s.size == size]
        ui = [s.ui_ms for s in of]
        lines.append(
            f"| {size[0]}x{size[1]} | {statistics.median(ui):,.0f} ({min(ui):,.0f}-"
            f"{max(ui):,.0f}) | {statistics.median(s.gc2_ms for s in of):,.0f} | "
            f"{statistics.median(s.refreshes for s in of):.0f} | "
            f"{statistics.median(s.laid_out for s in of):.0f} of {n_messages} |")
    ui = [s.ui_ms for s in samples]
    lines.append(f"| all {len(samples)} | {statistics.median(ui):,.0f} ({min(ui):,.0f}-"
                 f"{max(ui):,.0f}) | {statistics.median(s.gc2_ms for s in samples):,.0f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.bench_resize", description=__doc__
                                     .split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=40, help="questions and answers")
    parser.add_argument("--rounds", type=int, default=3, help="times through the sizes")
    args = parser.parse_args(argv)
    print(table(*asyncio.run(measure(args.exchanges, args.rounds))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
