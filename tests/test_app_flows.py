"""Pilot tests of the app's flows, on the real engine with the `tiny` preset."""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path

import pytest
from gates import Gate
from test_app_store import store_all
from test_app_widgets import plain
from textual.events import Paste
from textual.notifications import Notify
from textual.widgets import Input, Markdown, Switch

from app.app import StrataApp
from app.config import ChatConfig
from app.scenes import sample_paste, wait_ready, wait_until
from app.store import Store
from app.widgets.chat_log import MessageView, printable
from app.widgets.chunk_plan import ChunkPlan
from app.widgets.flags_panel import FlagsPanel
from app.widgets.prompt_input import Composer, PromptInput, expand
from app.widgets.timing_panel import TimingPanel
from app.widgets.vram_bar import BLOCK, VramBar
from engine.config import EngineOptions, LoanFlags
from engine.loan.forecast import seconds_text
from engine.request.conversation import Conversation
from engine.request.record import reused_tokens
from engine.runtime.serve import ServeLoop
from engine.trace.events import PrefillProgress

MAX_NEW = 8
SIZE = (120, 40)


def async_test(fn):
    """Run an async test body with asyncio.run (no pytest async plugin needed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def make_app(tmp_path: Path, flags: LoanFlags | None = None, **options: object) -> StrataApp:
    config = ChatConfig(
        EngineOptions(**{"model": "tiny", **options}), flags or LoanFlags(), max_new=MAX_NEW
    )
    store = Store.open(tmp_path / "conversations.sqlite3")
    return StrataApp(config, store=store, export_dir=tmp_path / "exports")


def reference_reply(prompts: list[str], **options: object) -> str:
    """What a separate engine answers to the last prompt after the earlier ones."""
    loop = ServeLoop.create(EngineOptions(model="tiny", **options))
    conv = Conversation()
    reply = ""
    for prompt in prompts:
        reply = loop.chat(conv, prompt, max_new=MAX_NEW).text
    return reply


async def send(pilot, text: str) -> None:
    app = pilot.app
    n = len(app.conv.messages)
    await pilot.press(*text)
    await pilot.press("enter")
    await wait_until(pilot, lambda: not app.running and len(app.conv.messages) == n + 2)


@async_test
async def test_send_streams_the_engine_answer_and_saves_it(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "hello")
        expected = reference_reply(["hello"])
        assert [m.role for m in app.conv.messages] == ["user", "assistant"]
        assert app.conv.messages[1].content == expected
        answer = app.query(MessageView).last()
        assert answer.role == "assistant"
        assert answer.query_one(Markdown).source == printable(expected)
        assert app.query_one(PromptInput).text == ""
        done = app.query_one(TimingPanel).done
        assert done is not None and not done.cancelled and done.generated >= 1
        assert app.query_one(ChunkPlan).plan is not None
        saved = app.store.load(app.conv.id)
        assert saved is not None
        assert [m.content for m in saved.messages] == ["hello", expected]


@async_test
async def test_ctrl_j_inserts_a_newline_and_enter_sends(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("a", "ctrl+j", "b")
        assert app.query_one(PromptInput).text == "a\nb"
        assert not app.running
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.conv.messages) == 2 and not app.running)
        assert app.conv.messages[0].content == "a\nb"


@async_test
async def test_long_paste_collapses_into_a_chip_and_expands_when_sent(tmp_path: Path) -> None:
    flags = LoanFlags(elastic_loan=True, repeat_loan=True)
    app = make_app(tmp_path, flags, serve=True, vram_elastic=True)
    small, big = sample_paste(11), sample_paste(30)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        loop = app.link.loop
        n_small, n_big = loop.count_tokens(small), loop.count_tokens(big)
        prompt = app.query_one(PromptInput)
        await pilot.press(*"see: ")
        app.post_message(Paste(small))
        await pilot.pause()
        app.post_message(Paste(" and "))  # short: typed into the text as it is
        await pilot.pause()
        app.post_message(Paste(big))
        composer = app.query_one(Composer)
        await wait_until(pilot, lambda: len(composer.pastes) == 2 and composer.verdict is not None
                         and all(p.n_tokens is not None for p in composer.pastes))
        first, second = composer.pastes
        assert (first.n_lines, first.n_tokens) == (11, n_small)
        assert (second.n_lines, second.n_tokens) == (30, n_big)
        assert prompt.text == f"see: {first.marker} and {second.marker}"
        # the last chip says what the engine says the whole message gets (here the startup loan)
        asked = loop.preview(app.conv, f"see: {small} and {big}")
        assert composer.verdict.kind == asked.kind == "startup"
        chips = str(composer.query_one("#chips").render()).splitlines()
        assert chips[0].endswith(f"11 lines · {n_small:,} tokens")
        assert chips[1].endswith(f"30 lines · {n_big:,} tokens · {asked.line()}")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.conv.messages) == 2 and not app.running)
        assert app.conv.messages[0].content == f"see: {small} and {big}"
        assert composer.pastes == ()


@async_test
async def test_the_chip_says_what_the_repeat_loan_will_buy(tmp_path: Path) -> None:
    """After the startup loan, the chip asks the engine: under the threshold no repeat loan
    (and why), over it the forecast without and with the loan; the same answer as the
    engine's own verdict on the message, fresh tokens counted against the KV it holds."""
    flags = LoanFlags(elastic_loan=True, repeat_loan=True)
    app = make_app(tmp_path, flags, serve=True, vram_elastic=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "hello")  # the startup loan
        composer, loop = app.query_one(Composer), app.link.loop
        app.post_message(Paste(sample_paste(11)))  # ~400 tokens: under 1,024
        await wait_until(pilot, lambda: composer.verdict is not None)
        verdict = composer.verdict
        assert verdict.kind is None and "fresh < 1,024" in verdict.reason
        assert verdict.with_loan is not None and verdict.with_loan.workload.kind == "repeat"
        chip = str(composer.query_one("#chips").render())
        assert f"no loan ({verdict.reason}): " in chip
        app.post_message(Paste(sample_paste(30)))  # together over 1,024: the repeat loan
        await wait_until(pilot, lambda: composer.verdict is not verdict
                         and composer.verdict is not None and len(composer.pastes) == 2)
        verdict = composer.verdict
        text = expand(app.query_one(PromptInput).text, composer.pastes)
        asked = loop.preview(app.conv, text)
        assert verdict.kind == asked.kind == "repeat" and verdict.line() == asked.line()
        conv = Conversation(messages=[*app.conv.messages])
        conv.add("user", text)
        ids = loop.prompt_ids(conv)  # the reply to "hello" is in the KV: reused, not fresh
        assert verdict.prompt_tokens == len(ids)
        reused = reused_tokens(loop.rt.session, loop.rt.spec, ids)  # the request's own rule
        assert verdict.fresh_tokens == len(ids) - reused < len(ids)
        assert f"repeat loan: {seconds_text(verdict.without_loan.total_s)} -> " in str(
            composer.query_one("#chips").render())


@async_test
async def test_counting_a_paste_never_blocks_typing(tmp_path: Path) -> None:
    """The chip's tokens are counted in a worker: while the count is held, keys still reach
    the input; released, the count shows."""
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        held, counting = threading.Event(), threading.Event()
        count = composer.count_tokens

        def slow_count(text: str) -> int | None:
            counting.set()
            held.wait(30)
            return count(text)

        composer.count_tokens = slow_count
        app.post_message(Paste(sample_paste(40)))
        await wait_until(pilot, counting.is_set)
        await pilot.press(*"typed meanwhile")
        prompt = app.query_one(PromptInput)
        assert prompt.text.endswith("typed meanwhile")
        assert composer.pastes[0].n_tokens is None
        assert "counting tokens…" in str(composer.query_one("#chips").render())
        held.set()
        await wait_until(pilot, lambda: composer.pastes[0].n_tokens is not None)
        assert composer.pastes[0].n_tokens == app.link.count_tokens(sample_paste(40))


@async_test
async def test_a_paste_ending_in_a_newline_counts_its_lines(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    text = sample_paste(150) + "\n"  # what a terminal sends for 150 copied lines
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        app.post_message(Paste(text))
        await pilot.pause()
        composer = app.query_one(Composer)
        (paste,) = composer.pastes
        assert paste.n_lines == 150 and paste.marker == "[paste #1: 150 lines]"
        assert "150 lines ·" in str(composer.query_one("#chips").render())


@async_test
async def test_help_says_how_to_close_it(tmp_path: Path) -> None:
    from app.screens import HelpScreen

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        help_text = app.screen.query_one(Markdown)
        assert "Esc, F1 or q closes this help" in help_text.source
        assert app.screen.query_one("#help-body").border_subtitle.endswith("Esc closes")
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


@async_test
async def test_deleting_a_marker_drops_its_chip(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        app.post_message(Paste(sample_paste(12)))
        await pilot.pause()
        composer = app.query_one(Composer)
        assert len(composer.pastes) == 1
        composer.input.clear()
        await pilot.pause()
        assert composer.pastes == ()
        assert not composer.query_one("#chips").display


@async_test
async def test_escape_cancels_a_long_prefill_and_puts_the_prompt_back(tmp_path: Path) -> None:
    app = make_app(tmp_path, prefill=16)
    gate = Gate(app.link.bus, lambda e: isinstance(e, PrefillProgress) and e.chunk == 2)
    text = sample_paste(200)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        app.post_message(Paste(text))
        await wait_until(pilot, lambda: bool(composer.pastes))
        marker = composer.pastes[0].marker
        app.simulate_key("enter")  # pilot.press would wait for a quiet screen: the prefill's end
        plan = app.query_one(ChunkPlan)
        await wait_until(pilot, lambda: plan.progress is not None and plan.progress.chunk >= 2)
        n_chunks = plan.plan.n_chunks
        await pilot.press("escape")
        gate.release()
        await wait_until(pilot, lambda: not app.running)
        assert plan.progress.chunk < n_chunks, "the prefill finished before the cancel"
        assert app.conv.messages == []
        assert not app.query(MessageView)
        assert composer.input.text == marker
        assert [p.text for p in composer.pastes] == [text]
        done = app.query_one(TimingPanel).done
        assert done is not None and done.cancelled
        assert app.store.list() == []
        # the engine rolled back: the next message is answered as by a fresh engine
        composer.clear()
        await pilot.pause()
        await send(pilot, "hi")
        assert app.conv.messages[1].content == reference_reply(["hi"], prefill=16)


async def toggle_first_switch(pilot) -> Switch:
    await pilot.press("f3")  # focus the first loan switch (ELASTIC_LOAN)
    switch = pilot.app.focused
    assert isinstance(switch, Switch) and switch.id == "elastic_loan"
    await pilot.press("space")
    await pilot.pause(0.1)
    return switch


@async_test
async def test_escape_from_the_flags_panel_gives_the_input_its_focus_back(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        prompt = app.query_one(PromptInput)
        await pilot.press("f3")
        assert isinstance(app.focused, Switch)
        await pilot.press("escape")
        assert app.focused is prompt
        await pilot.press("f3")
        await pilot.press(*"hi")  # typing on a switch goes to the prompt
        assert app.focused is prompt and prompt.text == "hi"
        await pilot.press("f3", "space")  # keys the switch has bindings for stay with it
        assert isinstance(app.focused, Switch) and prompt.text == "hi"
        app.post_message(Paste(" there"))  # and so does a paste
        await pilot.pause()
        assert app.focused is prompt and prompt.text == "hi there"
        await pilot.press("f3")
        app.post_message(Paste(sample_paste(20)))  # a long one becomes a chip
        await pilot.pause()
        composer = app.query_one(Composer)
        assert app.focused is prompt and len(composer.pastes) == 1
        assert prompt.text == "hi there" + composer.pastes[0].marker


@async_test
async def test_escape_in_the_flags_panel_still_cancels_a_running_request(tmp_path: Path) -> None:
    app = make_app(tmp_path, prefill=16)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        app.post_message(Paste(sample_paste(200)))
        await wait_until(pilot, lambda: bool(composer.pastes))
        app.simulate_key("enter")
        await wait_until(pilot, lambda: app.running)
        app.simulate_key("f3")
        await wait_until(pilot, lambda: isinstance(app.focused, Switch))
        app.simulate_key("escape")
        timing = app.query_one(TimingPanel)
        # the panel gets the request's end in a message of its own, a moment after the app
        await wait_until(pilot, lambda: not app.running and timing.done is not None)
        assert timing.done.cancelled
        assert app.focused is composer.input


@async_test
async def test_accepted_flag_applies_from_the_next_message(tmp_path: Path) -> None:
    app = make_app(tmp_path, serve=True, vram_elastic=True)
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=lambda m: notes.append(m)) as pilot:
        await wait_ready(pilot)
        switch = await toggle_first_switch(pilot)
        await wait_until(pilot, lambda: app.link.loop.flags.elastic_loan)
        panel = app.query_one(FlagsPanel)
        assert switch.value is True
        assert panel.flags.elastic_loan
        assert "applies from the next message" in str(panel.query_one("#flags-status").render())
        titles = [n.notification.title for n in notes if isinstance(n, Notify)]
        assert "Flags accepted" in titles


@async_test
async def test_the_flags_panel_forecasts_a_change_and_the_timing_panel_its_error(
    tmp_path: Path,
) -> None:
    """Typing a threshold shows what a message would get if it applied, beside what it gets
    now (the engine's own what-if); a switch that applies shows the forecast from the next
    message; after a request the timing panel shows its forecast against what it took."""
    flags = LoanFlags(elastic_loan=True, repeat_loan=True)
    app = make_app(tmp_path, flags, serve=True, vram_elastic=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "hello")  # the startup loan
        done = app.query_one(TimingPanel).done
        assert done is not None and done.forecast_s > 0
        shown = plain(app.query_one(TimingPanel).render(), 60)
        assert "forecast" in shown and "· measured" in shown, shown
        panel, loop = app.query_one(FlagsPanel), app.link.loop
        box = panel.query_one("#repeat_min_tokens", Input)
        box.value = "8192"  # typed, not entered: a what-if
        await wait_until(pilot, lambda: "if applied" in panel.forecast.plain)
        high = loop.what_if(flags.with_changes(repeat_min_tokens=8192), loop.options, 4096)
        now = loop.what_if(loop.flags, loop.options, 4096)
        assert high.kind is None and now.kind == "repeat"
        assert panel.forecast.plain == (f"if applied, a 4,096-token message: {high.line()}\n"
                                        f"now: {now.line()}")
        assert loop.flags.repeat_min_tokens == 1024  # nothing applied
        box.value = "1024"  # back to the value in force: no what-if
        await wait_until(pilot, lambda: not panel.forecast.plain)
        await pilot.press("f3", "tab", "tab", "tab", "tab")  # to the REPEAT_LOAN switch
        assert isinstance(app.focused, Switch) and app.focused.id == "repeat_loan"
        await pilot.press("space")  # applies: the forecast from the next message
        await wait_until(pilot, lambda: "from the next message" in panel.forecast.plain)
        assert not loop.flags.repeat_loan
        assert "no loan (repeat loan off)" in panel.forecast.plain
        assert f"was: {now.line()}" in panel.forecast.plain


@async_test
async def test_refused_flag_shows_the_reasons_and_resets_the_switch(tmp_path: Path) -> None:
    app = make_app(tmp_path)  # no --serve, no --vram-elastic: the master switch is refused
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=lambda m: notes.append(m)) as pilot:
        await wait_ready(pilot)
        switch = await toggle_first_switch(pilot)
        panel = app.query_one(FlagsPanel)
        status = panel.query_one("#flags-status")
        await wait_until(pilot, lambda: "refused" in str(status.render()))
        await pilot.pause(0.1)
        assert switch.value is False
        assert not app.link.loop.flags.elastic_loan
        violations = app.link.loop.set_flags(LoanFlags(elastic_loan=True), app.link.loop.options)
        assert violations, "the engine accepts what the app showed as refused"
        shown = str(status.render())
        toasts = [n.notification for n in notes if isinstance(n, Notify)]
        refused = [t for t in toasts if t.title == "Flags refused"]
        assert refused
        for v in violations:
            assert v in shown.replace("\n", " ") or v in shown
            assert v in refused[-1].message


@async_test
async def test_reopen_restores_the_last_conversation_and_the_list_switches(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "first")
        first = app.conv.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        await send(pilot, "second")
        second = app.conv.id
        await pilot.press("ctrl+s")
        await pilot.pause()
        exported = tmp_path / "exports" / f"conversation-{second}.md"
        assert exported.read_text() == app.conv.to_markdown()
    assert first != second
    again = make_app(tmp_path)
    async with again.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert again.conv.id == second
        views = again.query(MessageView)
        assert views.first().content == "second"
        await pilot.press("ctrl+o")
        await pilot.pause()
        await pilot.press("down", "enter")  # the list is newest first: the second item is `first`
        await wait_until(pilot, lambda: again.conv.id == first)
        assert again.query(MessageView).first().content == "first"


@async_test
async def test_the_loading_dialog_is_drawn_before_the_engine_or_the_chat_start(
    tmp_path: Path,
) -> None:
    """The screen was blank for seconds: the last conversation was drawn and the engine
    started before the loading dialog was."""
    from app.screens import LoadingScreen

    store = Store.open(tmp_path / "conversations.sqlite3")
    conv = Conversation()
    conv.add("user", sample_paste(50))
    conv.add("assistant", "an answer")
    store_all(store, conv)
    store.close()
    app = make_app(tmp_path)
    seen: dict[str, object] = {}
    start = app.link.start

    def recording_start() -> None:
        screen = app.screen
        title = screen.query("#loading-title")
        drawn = bool(title) and bool(title.first().region)
        seen["dialog drawn"] = isinstance(screen, LoadingScreen) and drawn
        seen["messages"] = len(app.query(MessageView))
        start()

    app.link.start = recording_start  # type: ignore[method-assign]
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert seen == {"dialog drawn": True, "messages": 0}
        assert len(app.query(MessageView)) == 2 and app.conv.id == conv.id
        assert app.focused is app.query_one(PromptInput)


@async_test
async def test_the_conversation_list_searches_renames_and_deletes(tmp_path: Path) -> None:
    from app.screens import ConversationsScreen

    store = Store.open(tmp_path / "conversations.sqlite3")
    convs = {}
    for i, title in enumerate(("alpha notes", "beta plan", "gamma notes")):
        conv = Conversation(created=1000.0 + i)
        conv.add("user", title)
        conv.add("assistant", "ok")
        store_all(store, conv)
        store.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (2000 + i, conv.id))
        store.db.commit()
        convs[title] = conv
    store.close()
    alpha, gamma = convs["alpha notes"], convs["gamma notes"]
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert app.conv.id == gamma.id  # the last one updated
        await pilot.press("ctrl+o")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, ConversationsScreen)
        await pilot.press(*"NOTES")  # the search field has the focus; case does not matter
        assert [c.title for c in screen.shown()] == ["gamma notes", "alpha notes"]
        # the title comes selected: typing replaces it
        await pilot.press("down", "ctrl+r", *"old notes", "enter")
        await pilot.pause()
        assert app.store.load(alpha.id).title == "old notes"
        assert [c.title for c in screen.shown()] == ["gamma notes", "old notes"]
        await pilot.press("up", "ctrl+d")  # asks first
        await pilot.pause()
        assert app.store.load(gamma.id) is not None
        await pilot.press("ctrl+d")
        await pilot.pause()
        assert app.store.load(gamma.id) is None
        assert [c.title for c in screen.shown()] == ["old notes"]
        assert app.conv.id != gamma.id and not app.conv.messages  # it was open: a new one
        await pilot.press("enter")  # opens what is highlighted
        await wait_until(pilot, lambda: app.conv.id == alpha.id)
        assert app.conv.title == "old notes"
        assert app.query(MessageView).first().content == "alpha notes"


@pytest.mark.parametrize("width, shown", [(120, True), (80, False)])
@async_test
async def test_dashboard_collapses_on_small_terminals(
    tmp_path: Path, width: int, shown: bool
) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(width, 24)) as pilot:
        await wait_ready(pilot)
        dashboard = app.query_one("Dashboard")
        assert dashboard.display is shown
        await pilot.press("f2")
        await pilot.pause()
        assert dashboard.display is not shown
        assert app.query_one("#chat-pane").display  # the chat and its input stay


@async_test
async def test_a_live_resize_lays_out_for_the_new_size(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_ready(pilot)
        dashboard, chat = app.query_one("Dashboard"), app.query_one("#chat-pane")
        assert dashboard.display and chat.display
        await pilot.resize_terminal(80, 30)  # narrow: the dashboard steps aside at once
        await pilot.pause()
        assert app.narrow and not dashboard.display and chat.display
        await pilot.resize_terminal(130, 30)
        await pilot.pause()
        assert not app.narrow and dashboard.display and chat.display
        assert dashboard.region.right == 130 and chat.region.x == 0
        bar = app.query_one(VramBar)  # the pictures are drawn for the new width too
        assert bar.render().plain.splitlines()[0] == BLOCK * bar.content_size.width


@async_test
async def test_palette_switches_drafting_to_every_step(tmp_path: Path) -> None:
    from app.commands import FlagCommands

    app = make_app(tmp_path, serve=True, mtp=True, spec=2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        spec = app.link.loop.rt.spec
        assert spec is not None and not spec.always
        found = {name: run for name, run, _ in FlagCommands(app.screen).commands()}
        found["Speculative decoding: draft on every step"]()
        await send(pilot, "hello")  # accepted flags apply from the next message
        assert spec.always and app.link.loop.options.spec_always
        again = {name for name, _, _ in FlagCommands(app.screen).commands()}
        assert "Speculative decoding: draft only while it pays (measured)" in again


@async_test
async def test_palette_sets_the_expert_cache_policy(tmp_path: Path) -> None:
    from app.commands import FlagCommands

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        experts = app.link.loop.rt.experts
        assert experts.policy == "static"  # auto on the simulated device
        found = {name: run for name, run, _ in FlagCommands(app.screen).commands()}
        assert "Expert cache: auto policy" not in found  # the one in force
        found["Expert cache: adaptive policy"]()
        await send(pilot, "hello")  # accepted options apply from the next message
        assert experts.policy == "adaptive" and app.link.loop.options.cache_policy == "adaptive"


@async_test
async def test_palette_and_panel_set_the_threshold_to_auto(tmp_path: Path) -> None:
    """STRATA_PREFILL_REPEAT_MIN_TOKENS=auto from the palette; the panel's box shows it and
    takes a count back (the forecast decides only while it says auto)."""
    from app.commands import FlagCommands

    flags = LoanFlags(elastic_loan=True, repeat_loan=True)
    app = make_app(tmp_path, flags, serve=True, vram_elastic=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        found = {name: run for name, run, _ in FlagCommands(app.screen).commands()}
        found["Loan flag: STRATA_PREFILL_REPEAT_MIN_TOKENS = auto"]()
        await pilot.pause()
        loop, box = app.link.loop, app.query_one("#repeat_min_tokens", Input)
        assert loop.flags.repeat_auto and box.value == "auto"
        again = {name for name, _, _ in FlagCommands(app.screen).commands()}
        assert "Loan flag: STRATA_PREFILL_REPEAT_MIN_TOKENS = auto" not in again
        assert "Loan flag: STRATA_PREFILL_REPEAT_MIN_TOKENS = 1,024" in again
        box.value = "2048"
        box.post_message(Input.Submitted(box, "2048"))  # what Enter sends
        await wait_until(pilot, lambda: not loop.flags.repeat_auto)
        assert loop.flags.repeat_min_tokens == 2048


def test_bench_decode_runs_strata_run_with_the_apps_options() -> None:
    """`python -m app.bench_decode` compares like with like: `strata run` gets the app's engine
    options and sampling (checked by parsing the command line back)."""
    from app.bench_decode import run_argv
    from app.config import add_chat_args, chat_config
    from engine.cli import OneLineParser

    parser = OneLineParser(prog="test")
    add_chat_args(parser)
    args = parser.parse_args(["--prefill", "512", "--kv", "q4_0", "--temperature", "0.7",
                              "--max-new", "32", "--spec", "3", "--ctx", "4096"])
    config = chat_config(args)
    argv = run_argv(config, "hello there")
    assert argv[:5] == ["run", "--prompt", "hello there", "--max-new", "32"]
    for flag in ("--serve", "--vram-elastic", "--mtp"):  # the app's defaults, made explicit
        assert flag in argv
    assert argv[argv.index("--spec") + 1] == "3" and argv[argv.index("--prefill") + 1] == "512"


@async_test
async def test_the_heap_built_at_load_is_frozen_while_the_app_runs(tmp_path: Path) -> None:
    """A full collection then scans only what came after the load (it stopped both threads for
    ~65 ms every few hundred generated tokens)."""
    import gc

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


@async_test
async def test_the_header_and_the_empty_chat_say_what_the_model_is(tmp_path: Path) -> None:
    """The demo is named honestly (a MoE trained on WordNet) and the empty chat suggests
    messages that work, both from the model file (the Ready event), not the app."""
    app = make_app(tmp_path, model="demo")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await wait_until(pilot, lambda: "WordNet" in app.sub_title)
        assert "4 layers · 32 experts (4 active)" in app.sub_title
        welcome = str(app.query_one("#chat-empty").render())
        assert "dictionary to chat with" in welcome and "What is a cat?" in welcome
        await send(pilot, "What is a cat?")
        assert "feline" in app.conv.messages[1].content
        # the welcome is gone with the first message; the empty input still says what works
        prompt = app.query_one(PromptInput)
        assert not app.query_one("#chat-empty").display and prompt.text == ""
        assert prompt.placeholder.startswith("Try: house") and "What is a cat?" in prompt.placeholder
        shown = "\n".join(prompt.render_line(y).text for y in range(prompt.size.height))
        assert "Try: house" in shown
