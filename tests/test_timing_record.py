"""A request whose only token came from the prompt's logits ran no decode step: the timing
line, the RequestDone record and the app's timing panel show no TG for it."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from textual.app import App, ComposeResult

from app.engine_link import EngineLink
from app.widgets.timing_panel import TimingPanel
from engine.cli import main
from engine.config import EngineOptions, LoanFlags
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from engine.trace.events import RequestDone
from engine.trace.timing import Timing


def test_the_timing_line_omits_tg_without_a_decode_step() -> None:
    one = Timing(prompt_tokens=16, fresh_tokens=16, prefill_s=0.01, generated=1, decode_s=2.4e-4)
    assert not one.decoded and one.tg_tok_s == 0.0
    assert one.line() == (
        "strata serve: prompt 16 tokens = 0 reused + 16 read in 10 ms (1600.0 tok/s), "
        "1 generated (no decode step), drafts accepted 0 of 0"
    )
    two = Timing(prompt_tokens=16, fresh_tokens=16, prefill_s=0.01, generated=2, decode_s=0.02)
    assert two.decoded and two.tg_tok_s == pytest.approx(100.0)
    assert "2 generated in 20 ms (100.0 tok/s)" in two.line()


@pytest.mark.parametrize("extra", [[], ["--mtp", "--spec", "2"]], ids=["plain", "spec"])
def test_run_max_new_1_prints_no_tg(extra: list[str], tiny_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", str(tiny_path), "--prompt", "hi", "--max-new", "1",
                 *extra]) == 0
    line = capsys.readouterr().err.splitlines()[-1]
    assert "1 generated (no decode step)" in line and line.count("tok/s") == 1, line


def test_the_request_record_says_no_decode_ran(tiny_path: Path) -> None:
    loop = ServeLoop.create(EngineOptions(model=str(tiny_path), ctx=256), LoanFlags())
    done: list[RequestDone] = []
    loop.bus.subscribe(lambda e: done.append(e) if isinstance(e, RequestDone) else None)
    loop.complete([5, 17, 300], SamplingParams(), 1)
    loop.complete([5, 17, 300, 9], SamplingParams(), 3)
    assert [(d.generated, d.decoded) for d in done] == [(1, False), (3, True)]


class Host(App[None]):
    def compose(self) -> ComposeResult:
        yield TimingPanel()


def panel_text(done: RequestDone) -> str:
    from rich.console import Console

    async def run() -> str:
        app = Host()
        async with app.run_test(size=(100, 20)) as pilot:
            panel = app.query_one(TimingPanel)
            panel.post_message(EngineLink.Events((done,)))
            await pilot.pause()
            await pilot.pause()
            console = Console(width=100, record=True, color_system=None, file=io.StringIO())
            console.print(panel.render())
            return console.export_text()

    return asyncio.run(run())


def test_the_timing_panel_shows_no_tg_without_a_decode_step() -> None:
    one = RequestDone(16, 0, 16, 0.01, 1, 0.00024, 0.0103, 0, 0, 0, decoded=False)
    text = panel_text(one)
    assert "1,600.0 tok/s" in text and text.count("tok/s") == 1, text  # PP only
    two = RequestDone(16, 0, 16, 0.01, 2, 0.02, 0.0103, 0, 0, 0)
    assert "100.0 tok/s" in panel_text(two)


def test_bench_spec_refuses_a_run_without_decode_steps(tiny_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-spec", "--model", str(tiny_path), "--max-new", "1"]) == 2
    err = capsys.readouterr().err
    assert err == ("strata: error: --max-new 1 runs no decode step, so there is no decode speed "
                   "to measure; give at least 2\n")
