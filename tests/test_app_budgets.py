"""Honest budgets (issue 28, items 5 and 7): a message that cannot fit --ctx is said before it
is sent and refused; a stopped prefill reports the chunks it read and the time it took; a
failure is 'failed', never 'cancelled'; a paste's chip is one unit for the keyboard; blank
messages are not sent; the event log shows each loan step once and wraps; the master switch
turns off in one step. Real engine (`tiny`), real app, the Textual pilot."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from gates import Gate
from rich.console import Console
from test_app_flows import async_test, make_app
from textual.events import Key, Paste
from textual.notifications import Notify
from textual.widgets import Switch

from app.engine_link import EngineLink
from app.message_text import stray_markers, tidy, whole_markers
from app.scenes import sample_paste, wait_ready, wait_until
from app.widgets.event_log import EventLog
from app.widgets.flags_panel import FlagsPanel
from app.widgets.prompt_input import Composer, PromptInput
from app.widgets.timing_panel import TimingPanel
from engine.backend.base import SIM_TRAITS
from engine.config import EngineOptions, LoanFlags
from engine.errors import ContextFullError
from engine.faults import Faults, InjectedFault
from engine.loan import guards
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.trace.events import (
    EventBus,
    FlagsRefused,
    LoanStep,
    PrefillProgress,
    RequestDone,
    RequestStarted,
    TraceLine,
)

SIZE = (120, 40)
CHUNK = 16  # --prefill 16: a 200-line paste is many chunks


def engine(bus: EventBus | None = None, faults: Faults | None = None,
           **options: object) -> ServeLoop:
    return ServeLoop.create(EngineOptions(**{"model": "tiny", **options}), bus=bus,
                            faults=faults)


def recorded(bus: EventBus) -> list[object]:
    seen: list[object] = []
    bus.subscribe(seen.append)
    return seen


def notes_of(notes: list[Notify]) -> list[str]:
    return [n.notification.message for n in notes if isinstance(n, Notify)]


async def type_keys(pilot, keys: list[str], then: str) -> None:
    """Key events sent to the app as a terminal sends a fast typist's keys, one after the
    other with no wait between them (pilot.press waits for the app to idle after each, ~60 ms
    a key here); returns once the input holds `then`."""
    names = {" ": "space", "!": "exclamation_mark"}
    for key in keys:
        pilot.app.post_message(Key(names.get(key, key), key if len(key) == 1 else None))
    prompt = pilot.app.query_one(PromptInput)
    await wait_until(pilot, lambda: prompt.text == then)


# -- the engine: the context rule, what a stopped prefill read, failed vs cancelled ---------
def test_a_message_that_cannot_fit_is_refused_before_anything_is_read() -> None:
    bus = EventBus()
    seen = recorded(bus)
    loop = engine(bus, ctx=256)
    conv = Conversation()
    loop.chat(conv, sample_paste(4), max_new=4)  # ~150 tokens in the conversation
    kv = list(loop.rt.session.tokens)
    text = sample_paste(3)  # fits alone, not after the conversation
    with pytest.raises(ContextFullError) as asked:
        loop.preview(conv, text)
    n_started = sum(isinstance(e, RequestStarted) for e in seen)
    with pytest.raises(ContextFullError) as sent:
        loop.chat(conv, text, max_new=4)
    e = sent.value
    assert str(e) == str(asked.value)
    whole = Conversation(messages=[*conv.messages])
    whole.add("user", text)
    assert e.n_prompt == len(loop.prompt_ids(whole)) >= 256 and e.ctx == 256
    assert e.n_message == loop.count_tokens(text)
    assert e.n_conversation == e.n_prompt - e.n_message
    assert e.fits_alone and "start a new conversation" in str(e)
    assert f"{e.n_message:,} tokens + {e.n_conversation:,} in the conversation" in str(e)
    # refused before admission: no request, the conversation and the KV as they were
    assert sum(isinstance(e, RequestStarted) for e in seen) == n_started
    assert len(conv.messages) == 2 and loop.rt.session.tokens == kv
    with pytest.raises(ContextFullError) as alone:  # too long for any conversation
        loop.preview(Conversation(), sample_paste(12))
    assert not alone.value.fits_alone and "new conversation" not in str(alone.value)


def test_a_cancelled_prefill_reports_the_chunks_it_read_and_their_time() -> None:
    bus = EventBus()
    seen = recorded(bus)
    loop = engine(bus, prefill=CHUNK)

    def cancel_at_chunk_3(event: object) -> None:
        if isinstance(event, PrefillProgress) and event.chunk == 3:
            loop.cancel()  # on the engine thread, before the chunk's cancel check

    bus.subscribe(cancel_at_chunk_3)
    conv = Conversation()
    reply = loop.chat(conv, sample_paste(40), max_new=4)
    assert reply.cancelled and reply.withdrawn
    progress = [e for e in seen if isinstance(e, PrefillProgress)]
    (done,) = [e for e in seen if isinstance(e, RequestDone)]
    assert done.cancelled and not done.failed
    assert done.read_tokens == progress[-1].tokens_done == 3 * CHUNK == done.n_read
    assert done.fresh_tokens == progress[-1].tokens_total > done.n_read
    assert done.prefill_s > 0 and done.generated == 0
    assert f"{done.fresh_tokens} fresh, {3 * CHUNK} read before it stopped" in done.line
    assert reply.timing.pp_tok_s == pytest.approx(3 * CHUNK / done.prefill_s)


def test_a_failure_is_failed_not_cancelled_and_says_why() -> None:
    bus = EventBus()
    seen = recorded(bus)
    faults = Faults()
    loop = engine(bus, faults, prefill=CHUNK)
    faults.arm("chunk:1")  # the second chunk is read, then the engine fails
    conv = Conversation()
    with pytest.raises(InjectedFault):
        loop.chat(conv, sample_paste(40), max_new=4)
    (done,) = [e for e in seen if isinstance(e, RequestDone)]
    assert done.failed and not done.cancelled
    assert done.error == "fault injected at chunk:1"
    assert done.read_tokens == 2 * CHUNK and done.prefill_s > 0
    assert conv.messages == []


def test_off_is_one_step_for_the_master_switch() -> None:
    all_on = LoanFlags(elastic_loan=True, mtp_loan=True, head_loan=True,
                       retain_startup_chunk=True, repeat_loan=True)
    off = all_on.with_changes(elastic_loan=False)
    assert not off.elastic_loan and off.sub_options_on() == ()
    assert guards.validate(EngineOptions(), off, SIM_TRAITS, True, True) == []
    # a sub-option named with the master off is still the refused combination
    named = all_on.with_changes(elastic_loan=False, repeat_loan=True)
    assert any("needs the master switch" in v
               for v in guards.validate(EngineOptions(), named, SIM_TRAITS, True, True))


# -- pure text rules -------------------------------------------------------------------------
def test_the_text_rules() -> None:
    line = "see [paste #2: 358 lines] and"
    a, b = line.index("["), line.index("]") + 1
    get = [line].__getitem__
    assert whole_markers(get, (0, b), (0, b - 1)) == ((0, a), (0, b))  # Backspace at its end
    assert whole_markers(get, (0, a), (0, a + 1)) == ((0, a), (0, b))  # Delete at its start
    assert whole_markers(get, (0, a + 3), (0, a + 3)) == ((0, b), (0, b))  # typed inside
    assert whole_markers(get, (0, 0), (0, 2)) == ((0, 0), (0, 2))  # elsewhere: as it was
    assert stray_markers(line, {"[paste #2: 358 lines]"}) == []
    assert stray_markers(line, set()) == ["[paste #2: 358 lines]"]
    assert tidy("  \n\n  hello  \n \n") == "hello"
    assert tidy("\n\n    def f():\n        pass\n\n") == "    def f():\n        pass"
    assert tidy(" \t\n \n") == ""


# -- the app ---------------------------------------------------------------------------------
@async_test
async def test_a_paste_that_cannot_fit_says_so_and_enter_refuses(tmp_path: Path) -> None:
    app = make_app(tmp_path, ctx=256)
    notes: list[Notify] = []
    text = sample_paste(12)
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        app.post_message(Paste(text))
        await wait_until(pilot, lambda: composer.query_one("#too-long").display)
        with pytest.raises(ContextFullError) as engine_says:
            app.link.loop.preview(app.conv, text)
        e = engine_says.value
        line = str(composer.query_one("#too-long").render())
        assert f"{e.n_message:,} tokens + {e.n_conversation:,} in the conversation = " \
               f"{e.n_prompt:,} >= --ctx 256" in line
        assert "cannot fit --ctx" in str(composer.query_one("#chips").render())
        assert "loan" not in str(composer.query_one("#chips").render())
        assert composer.input.has_class("-too-long")
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert not app.running and app.conv.messages == []
        assert any(m.startswith("cannot fit: ") for m in notes_of(notes))
        assert composer.input.text == composer.pastes[0].marker  # kept to be shortened


@async_test
async def test_a_typed_message_that_cannot_fit_says_so_and_enter_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, ctx=256)
    notes: list[Notify] = []
    text = ("the quick brown fox jumps over the lazy dog " * 12).strip()  # ~320 tokens
    short = text[:60].strip()
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        line = composer.query_one("#too-long")
        asked: list[str] = []
        ask = composer.ask

        def counted(message: str) -> object:  # the engine's own answer, counted
            asked.append(message)
            return ask(message)

        composer.ask = counted
        await type_keys(pilot, list(text), then=text)  # typed, key by key: no paste, no chip
        await wait_until(pilot, lambda: line.display)
        assert composer.pastes == () and not composer.query_one("#chips").display
        assert len(asked) < len(text) // 20, len(asked)  # once typing pauses, not every key
        with pytest.raises(ContextFullError) as engine_says:
            app.link.loop.preview(app.conv, text)
        e = engine_says.value
        shown = str(line.render())
        assert f"{e.n_message:,} tokens + {e.n_conversation:,} in the conversation = " \
               f"{e.n_prompt:,} >= --ctx 256" in shown
        assert "shorten the message or restart with a larger --ctx" in shown
        assert composer.input.has_class("-too-long")
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert not app.running and app.conv.messages == []
        assert any(m.startswith("cannot fit: ") for m in notes_of(notes))
        assert composer.input.text == text  # kept, to be shortened
        # shortened: the line goes once the engine says it fits; Enter sends it
        await type_keys(pilot, ["backspace"] * (len(text) - len(short)), then=short)
        await wait_until(pilot, lambda: not line.display)
        assert not composer.input.has_class("-too-long")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.conv.messages) == 2 and not app.running)
        assert app.conv.messages[0].content == short
        # Enter right after an edit of a message that could not fit waits for the engine's
        # answer about the edited text: too long still, refused; short enough, sent
        monkeypatch.setattr("app.widgets.prompt_input.MEASURE_DELAY_S", 60.0)  # no pause ends
        composer.input.load_text(text)
        composer.input.move_cursor(composer.input.document.end)
        composer.measure()
        await wait_until(pilot, lambda: line.display)
        n_notes = len(notes_of(notes))
        await pilot.press("!", "enter")
        await wait_until(pilot, lambda: len(notes_of(notes)) > n_notes)
        assert notes_of(notes)[-1].startswith("cannot fit: ")
        assert len(app.conv.messages) == 2 and composer.input.text == text + "!"
        await type_keys(pilot, ["backspace"] * (len(text) + 1 - len(short)), then=short)
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.conv.messages) == 4 and not app.running)
        assert app.conv.messages[2].content == short and not line.display
        # more bytes than --ctx could hold: refused before the tokenizer sees it, said the same
        huge = "word " * 1000
        composer.input.load_text(huge)
        composer.measure()
        await wait_until(pilot, lambda: line.display)
        assert str(line.render()).startswith("cannot fit: the text is over 4,096 bytes")
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert len(app.conv.messages) == 4 and composer.input.text == huge


@async_test
async def test_cancel_shows_the_chunks_the_engine_read(tmp_path: Path) -> None:
    app = make_app(tmp_path, prefill=CHUNK)
    gate = Gate(app.link.bus, lambda e: isinstance(e, PrefillProgress) and e.chunk == 2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        app.post_message(Paste(sample_paste(200)))
        await wait_until(pilot, lambda: bool(composer.pastes))
        app.simulate_key("enter")
        await wait_until(pilot, gate.reached.is_set)
        await pilot.press("escape")
        gate.release()  # the engine checks the cancel right after chunk 2
        await wait_until(pilot, lambda: not app.running)
        done = app.query_one(TimingPanel).done
        assert done is not None and done.cancelled and not done.failed
        assert done.n_read == 2 * CHUNK < done.fresh_tokens and done.prefill_s > 0
        panel = plain_render(app.query_one(TimingPanel))
        assert f"{2 * CHUNK} of {done.fresh_tokens:,} in " in panel, panel
        assert f"+ {done.fresh_tokens:,} fresh, {2 * CHUNK} read" in panel
        assert "0.0 ms" not in panel


def plain_render(widget: TimingPanel) -> str:
    console = Console(width=60, record=True, file=io.StringIO())
    console.print(widget.render())
    return console.export_text()


@async_test
async def test_one_backspace_removes_the_chip_and_ctrl_z_brings_it_back(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        composer, prompt = app.query_one(Composer), app.query_one(PromptInput)
        await pilot.press(*"see ")
        app.post_message(Paste(sample_paste(30)))
        await wait_until(pilot, lambda: len(composer.pastes) == 1)
        marker = composer.pastes[0].marker
        await pilot.press("backspace")
        await pilot.pause()
        assert prompt.text == "see " and composer.pastes == ()
        assert any("paste #1 (30 lines) removed" in m for m in notes_of(notes))
        await pilot.press("ctrl+z")
        await pilot.pause()
        assert prompt.text == f"see {marker}" and len(composer.pastes) == 1
        # typed inside the marker: the text lands after it, the chip stays
        await pilot.press("left", "left", "left", "x")
        await pilot.pause()
        assert prompt.text == f"see {marker}x" and len(composer.pastes) == 1
        # Delete at the marker's start takes it whole too
        prompt.move_cursor((0, 4))
        await pilot.press("delete")
        await pilot.pause()
        assert prompt.text == "see x" and composer.pastes == ()
        # a marker that names no paste is never sent as its characters
        prompt.load_text("see [paste #9: 12 lines]")
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert not app.running and app.conv.messages == []
        assert any("[paste #9: 12 lines] names no paste" in m for m in notes_of(notes))
        # the marker of a paste removed, typed back: its chip is back, and it sends the paste
        prompt.load_text(f"see {marker}")
        await pilot.pause()
        assert [p.marker for p in composer.pastes] == [marker]
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.conv.messages) == 2 and not app.running)
        assert app.conv.messages[0].content == f"see {sample_paste(30)}"


@async_test
async def test_blank_messages_are_not_sent_and_sent_ones_are_tidied(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        prompt = app.query_one(PromptInput)
        await pilot.press("space", "space", "ctrl+j", "space", "enter")
        await pilot.pause(0.2)
        assert not app.running and app.conv.messages == []
        assert any("Nothing to send" in m for m in notes_of(notes))
        prompt.load_text("\n  \n   hello there  \n\n")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.conv.messages) == 2 and not app.running)
        assert app.conv.messages[0].content == "hello there"
        assert app.store.load(app.conv.id).messages[0].content == "hello there"


@async_test
async def test_the_event_log_shows_each_loan_step_once_and_wraps_refusals(
        tmp_path: Path) -> None:
    flags = LoanFlags(elastic_loan=True)  # demo: its prompt path lends cache-tail slots
    app = make_app(tmp_path, flags, model="demo", serve=True, vram_elastic=True, mtp=True,
                   spec=2)
    bus_lines: list[str] = []
    app.link.bus.subscribe(lambda e: bus_lines.append(e.text) if isinstance(e, TraceLine)
                           else None)
    steps: list[LoanStep] = []
    app.link.bus.subscribe(lambda e: steps.append(e) if isinstance(e, LoanStep) else None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        log = app.query_one(EventLog)
        app.post_message(Paste(sample_paste(11)))
        await wait_until(pilot, lambda: bool(app.query_one(Composer).pastes))
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.conv.messages) == 2 and not app.running)
        await pilot.pause(0.3)
        shown = [e.plain for e in log._entries]
        assert not any("strata loan: strata " in line for line in shown), shown
        refills = [s for s in steps if s.step == "refill"]
        assert refills and any(line.startswith("strata trace: refilled") for line in bus_lines)
        for step in refills + [s for s in steps if s.step == "release"]:
            matching = [line for line in shown if step.detail in line]
            assert len(matching) == 1, (step, shown)
        why = ("STRATA_PREFILL_MTP_LOAN=1 needs --mtp with --spec >= 2 and a reason long "
               "enough to wrap in the dashboard's pane two or three times over, at the least")
        log.post_message(EngineLink.Events((FlagsRefused((why,)),)))
        await pilot.pause(0.3)
        width = log.scrollable_content_region.width
        rows = [strip.text.rstrip() for strip in log.lines[-4:]]
        assert all(len(r) <= width for r in rows), (width, rows, log.size)
        assert " ".join(r.strip() for r in rows).endswith("over, at the least"), rows


@async_test
async def test_the_master_switch_turns_off_in_one_step(tmp_path: Path) -> None:
    flags = LoanFlags(elastic_loan=True, mtp_loan=True, head_loan=True, repeat_loan=True,
                      retain_startup_chunk=True)
    app = make_app(tmp_path, flags, serve=True, vram_elastic=True, mtp=True, spec=2)
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        await pilot.press("f3")
        switch = app.focused
        assert isinstance(switch, Switch) and switch.id == "elastic_loan"
        await pilot.press("space")
        await pilot.pause(0.2)
        loop = app.link.loop
        assert not loop.flags.elastic_loan and loop.flags.sub_options_on() == ()
        panel = app.query_one(FlagsPanel)
        assert [s.value for s in panel.query(Switch)] == [False] * 5
        status = str(panel.query_one("#flags-status").render())
        assert "off with the master switch: MTP_LOAN, HEAD_LOAN, RETAIN_STARTUP_CHUNK, " \
               "REPEAT_LOAN" in status.replace("\n", " ")
        assert not [n for n in notes if isinstance(n, Notify)
                    and n.notification.title == "Flags refused"]
