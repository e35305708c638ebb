"""Snapshot tests at 80x24 and 160x48 (pytest-textual-snapshot, the `tiny` preset) of the
screens issue 28 asks for beside the chat: F4's sampling panel and system prompt, ctrl+o's
search, and what a cancelled prefill leaves on the screen.

The cancel is real: the app's defaults (a startup loan), a paste of three prompt chunks, Esc
while the engine holds at its first chunk's progress, so it stops after exactly one chunk. The
engine's clock readings (event times, chunk and step milliseconds) change every run: the bus the
app listens to (`SteadyBus`) hands on every event the engine publishes with chosen readings
instead, as the dashboard's snapshot feeds chosen numbers; the tokens, chunks, bytes and the
order of the events stay the engine's.

Update with `pytest tests/test_app_screen_snapshots.py --snapshot-update` after a deliberate
change, and look at the report it writes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_app_layout_snapshots import SIZES, reopened_app, settled, still
from test_app_store import conversation, store_all
from textual.events import Paste
from textual.widgets import Input, OptionList, TextArea

import app.engine_link
from app.app import StrataApp
from app.config import APP_FLAGS, ChatConfig
from app.scenes import loan_ready, sample_paste, wait_ready, wait_until
from app.screens import ConversationsScreen
from app.store import Store
from app.widgets.chat_settings import ChatSettingsScreen
from app.widgets.prompt_input import Composer
from engine.trace.events import (
    Event,
    EventBus,
    LoanStep,
    PrefillProgress,
    RequestDone,
    RequestStarted,
    Token,
    TraceLine,
)

size_ids = pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")


async def laid_out(pilot) -> None:  # type: ignore[no-untyped-def]
    """The screen laid out twice more. A dashboard picture draws at its last laid-out width
    (`EventView.content_width`), so the layout that first gives it a new width (the
    dashboard's scrollbar came) may measure it at the old one, a line taller than its drawing;
    a dialog opened then keeps the screen below as it was."""
    for _ in range(2):
        pilot.app.screen.refresh(layout=True)
        await pilot.pause(0.1)


async def reopened(pilot) -> None:  # type: ignore[no-untyped-def]
    await settled(pilot)
    await laid_out(pilot)


async def chat_settings(pilot) -> ChatSettingsScreen:  # type: ignore[no-untyped-def]
    """The reopened conversation, then F4: its system prompt and sampling dialog."""
    await reopened(pilot)
    await pilot.press("f4")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, ChatSettingsScreen))
    screen = pilot.app.screen
    still(screen)
    return screen


# -- F4: the sampling panel and the system prompt ------------------------------------------
SAMPLING = (("temperature", "0.7"), ("top_p", "0.9"), ("top_k", "20"), ("seed", "1234"),
            ("max_tokens", "512"))


@size_ids
def test_sampling_panel(size: tuple[int, int], snap_compare, tmp_path: Path) -> None:
    """Each value typed into its field as a user does (Tab from the system prompt, clear,
    type); the focus stays on the last."""

    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        screen = await chat_settings(pilot)
        for key, text in SAMPLING:
            await pilot.press("tab", "end", "ctrl+u", *text)
            assert screen.focused is screen.query_one(f"#sampling-{key}", Input)
        assert {key: screen.query_one(f"#sampling-{key}", Input).value
                for key, _ in SAMPLING} == dict(SAMPLING)
        await pilot.pause(0.3)

    assert snap_compare(reopened_app(tmp_path), terminal_size=size, run_before=run_before)


SYSTEM = "You explain memory in one short paragraph and name the region you mean."


@size_ids
def test_system_prompt(size: tuple[int, int], snap_compare, tmp_path: Path) -> None:
    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        screen = await chat_settings(pilot)
        area = screen.query_one("#system-prompt", TextArea)
        assert screen.focused is area  # the dialog opens in the system prompt
        await pilot.press(*SYSTEM)
        assert area.text == SYSTEM
        await pilot.pause(0.3)

    assert snap_compare(reopened_app(tmp_path), terminal_size=size, run_before=run_before)


# -- ctrl+o: the conversations and a full-text search -----------------------------------------
@pytest.fixture
def utc() -> Iterator[None]:
    """Local time is UTC: the list's dates read the same on every machine."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def two_conversations_app(tmp_path: Path) -> StrataApp:
    """The reopened conversation (about the loan) and an older one (about a kettle), stored
    at fixed times."""
    app = reopened_app(tmp_path)
    assert app.store is not None
    (loan,) = app.store.list()
    kettle = conversation("How hot is a kettle when it whistles?",
                          "About 100 °C at sea level: the water boils and the steam sings.")
    store_all(app.store, kettle)
    for conv_id, updated in ((loan.id, 1_767_225_600.0), (kettle.id, 1_767_139_200.0)):
        app.store.db.execute("UPDATE conversations SET updated = ? WHERE id = ?",
                             (updated, conv_id))
    return app


@size_ids
def test_open_and_search(size: tuple[int, int], snap_compare, tmp_path: Path,
                         utc: None) -> None:
    """ctrl+o, then a word only the loan conversation's answers hold: one conversation is
    left, its best match shown with the word marked."""

    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        await reopened(pilot)
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, ConversationsScreen))
        screen = pilot.app.screen
        still(screen)
        options = screen.query_one("#conv-list", OptionList)
        assert options.option_count == 2
        await pilot.press(*"refilled")
        await wait_until(pilot, lambda: options.option_count == 1)
        (shown,) = screen.shown()
        hit = screen.hit(shown.id)
        assert hit is not None and hit.role == "assistant"
        assert [hit.snippet[a:b] for a, b in hit.marks] == ["refilled"]
        await pilot.pause(0.3)

    assert snap_compare(two_conversations_app(tmp_path), terminal_size=size,
                        run_before=run_before)


# -- a cancelled prefill -------------------------------------------------------------------
STEP_S = 0.05  # between two events the engine publishes
CHUNK_MS = 250.0  # a prompt chunk
LOAN_STEP_MS = 1.5  # a loan step (release, plan, ...) that took any time
_DURATION = re.compile(r"\d[\d,]*(?:\.\d+)? (ms|s|tok/s)\b")


def _scrubbed(text: str) -> str:
    """A line with its measured figures (durations, rates) replaced by '#'."""
    return _DURATION.sub(lambda m: f"# {m.group(1)}", text)


class SteadyBus(EventBus):
    """The engine's bus, handing on each event with chosen clock readings: event times
    `STEP_S` apart, every chunk `CHUNK_MS`, every loan step that took time `LOAN_STEP_MS`, a
    prefill as long as the chunks it read, measured figures in text lines as '#'. Everything
    else (the order, tokens, chunks, bytes, slots) is what the engine published. Tokens keep
    their time: the app paces an answer's frames by it."""

    def __init__(self) -> None:
        super().__init__()
        self._n = 0
        self._chunks = 0  # of the running request, read so far

    def publish(self, event: Event) -> None:
        self._n += 1
        if isinstance(event, RequestStarted):
            self._chunks = 0
        elif isinstance(event, PrefillProgress):
            self._chunks = event.chunk
        super().publish(self.steady(event, 1000.0 + self._n * STEP_S))

    def steady(self, event: Event, t: float) -> Event:
        if isinstance(event, Token):
            return event
        changes: dict[str, object] = {"t": t}
        if isinstance(event, PrefillProgress):
            changes["chunk_ms"] = CHUNK_MS
        elif isinstance(event, LoanStep):
            changes.update(ms=LOAN_STEP_MS if event.ms else 0.0, detail=_scrubbed(event.detail))
        elif isinstance(event, TraceLine):
            changes["text"] = _scrubbed(event.text)
        elif isinstance(event, RequestDone):
            assert not event.generated, "a cancel in the prefill: no answer to time"
            changes.update(prefill_s=self._chunks * CHUNK_MS / 1e3, line=_scrubbed(event.line))
        return dataclasses.replace(event, **changes)  # type: ignore[arg-type]


NOTE = "Cancelled; your prompt is back in the input."


@size_ids
def test_cancelled_prefill(size: tuple[int, int], snap_compare, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What Esc during a long paste's prefill leaves: the prompt back in the input (its chip
    and forecast), the note saying so, and the request cancelled after one chunk of three
    (768 of 2,139 tokens read) in the timing panel (160x48) or the strip (80x24)."""
    # the forecast on the chip learns from earlier requests: this test's cache has none
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(app.engine_link, "EventBus", SteadyBus)
    config = ChatConfig(loan_ready("tiny"), APP_FLAGS, max_new=8)  # the app's defaults
    strata = StrataApp(config, store=Store.open(tmp_path / "conversations.sqlite3"),
                       export_dir=tmp_path / "exports")
    assert isinstance(strata.link.bus, SteadyBus)
    at_first_chunk, cancelled = threading.Event(), threading.Event()
    done: list[RequestDone] = []

    def hold(event: Event) -> None:
        """On the engine's thread: the first chunk's progress waits for the Esc."""
        if isinstance(event, PrefillProgress) and not at_first_chunk.is_set():
            at_first_chunk.set()
            assert cancelled.wait(30), "no Esc came"
        elif isinstance(event, RequestDone):
            done.append(event)

    strata.link.bus.subscribe(hold)

    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        await wait_ready(pilot)
        composer = pilot.app.query_one(Composer)
        pilot.app.post_message(Paste(sample_paste(60)))
        await wait_until(pilot, lambda: composer.verdict is not None)
        await pilot.press("enter")
        await wait_until(pilot, at_first_chunk.is_set)
        await pilot.press("escape")
        await pilot.pause()
        cancelled.set()
        await wait_until(pilot, lambda: not pilot.app.running)
        (request,) = done
        assert request.cancelled and request.read_tokens == 768
        assert request.fresh_tokens == 2139 and not request.generated
        await wait_until(pilot, lambda: composer.verdict is not None)  # the chip's forecast
        await laid_out(pilot)
        # "Cancelling…" (2 s) gone; "Cancelled; your prompt is back in the input." (5 s) shown
        await wait_until(pilot, lambda: [str(toast.render()) for toast in
                                         pilot.app.screen.query("Toast")] == [NOTE])
        await pilot.pause(0.3)

    assert snap_compare(strata, terminal_size=size, run_before=run_before)
