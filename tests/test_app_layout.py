"""80x24 as a first-class size: the compact strip, F2 and F3 in one press, the footer and the
header at 80 columns, reopening at the latest message, help scrolled by keyboard, the
palette's Screenshot without ~/Downloads, the event log across a hidden resize, and the
`strata --version` / top-level help. Pilot tests on the `tiny` preset."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_app_flows import async_test, make_app, send
from test_app_store import store_all
from test_app_widgets import feed
from textual.widgets._footer import FooterKey
from textual.widgets._header import HeaderTitle

from app.app import StrataApp
from app.cli import main as strata_main
from app.commands import screenshot_dir
from app.config import ChatConfig
from app.scenes import wait_ready, wait_until
from app.screens import HelpScreen
from app.store import Store
from app.widgets.chat_log import ChatLog
from app.widgets.chrome import fit_subtitle
from app.widgets.compact_strip import CompactStrip
from app.widgets.dashboard import Dashboard
from app.widgets.event_log import EventLog
from app.widgets.flags_panel import SWITCHES, FlagsPanel
from app.widgets.prompt_input import PromptInput
from app.widgets.toggle import OFF, ON, Toggle
from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation, Message
from engine.trace.events import RequestDone

SMALL, LARGE = (80, 24), (160, 48)
ROOT = Path(__file__).resolve().parents[1]


def on_screen(app: StrataApp, widget) -> bool:
    """The widget has cells on the screen (displayed, laid out, not scrolled out of view)."""
    region = widget.region
    return bool(region) and app.screen.region.contains_region(region)


def long_conversation(n_exchanges: int = 12) -> Conversation:
    conv = Conversation()
    for i in range(n_exchanges):
        conv.messages.append(Message("user", f"question {i}"))
        conv.messages.append(Message(
            "assistant",
            f"Answer {i}, in **Markdown**:\n\n- one point\n- another point\n\n```python\n"
            f"def f(x):\n    return x + {i}\n```\n\nA closing paragraph long enough to wrap "
            "at eighty columns, so that a resize changes how tall every answer is.",
        ))
    return conv


# -- the compact strip, F2 and F3 ----------------------------------------------------------
@async_test
async def test_below_100_columns_a_strip_stands_for_the_dashboard(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await wait_ready(pilot)
        strip = app.query_one(CompactStrip)
        assert not app.query_one(Dashboard).display and on_screen(app, strip)
        first, second = strip.render().plain.splitlines()
        assert first.startswith("VRAM ") and " / " in first and "lent 0 of " in first
        assert second.startswith("no request yet")
        await send(pilot, "hello")
        await wait_until(pilot, lambda: "last request" in strip.render().plain)
        first, second = strip.render().plain.splitlines()
        assert "plan " in first and "PP " in second and "TG " in second
    async with make_app(tmp_path).run_test(size=LARGE) as pilot:  # the dashboard is beside
        await wait_ready(pilot)
        assert not pilot.app.query_one(CompactStrip).display
        assert on_screen(pilot.app, pilot.app.query_one(Dashboard))


def test_the_strip_says_how_much_a_stopped_prefill_read() -> None:
    """At 80x24 the strip is the timing panel: a request cancelled (or failed) in its
    prefill says how much of its prompt it read; one cancelled while answering read it all."""
    stopped = RequestDone(2139, 0, 2139, 0.25, 0, 0.0, 0.0, cancelled=True, decoded=False,
                          read_tokens=768)
    second = feed(CompactStrip(), stopped, size=(80, 4)).splitlines()[1]
    assert second == "last request PP 3,072.0 tok/s · TG – · cancelled: 768 of 2,139 read"
    failed = replace(stopped, cancelled=False, error="out of memory")
    assert feed(CompactStrip(), failed, size=(80, 4)).endswith("· failed: 768 of 2,139 read")
    answering = replace(stopped, read_tokens=None, generated=5, decode_s=0.1, decoded=True)
    assert feed(CompactStrip(), answering, size=(80, 4)).endswith("· TG 50.0 tok/s · cancelled")


@pytest.mark.parametrize("size", [SMALL, LARGE])
@async_test
async def test_f2_never_hides_the_input_or_the_chat(tmp_path: Path, size: tuple[int, int]) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        await wait_ready(pilot)
        dashboard, strip = app.query_one(Dashboard), app.query_one(CompactStrip)
        shown = dashboard.display
        for _ in range(2):
            await pilot.press("f2")
            await pilot.pause()
            shown = not shown
            assert dashboard.display is shown and strip.display is not shown
            assert on_screen(app, app.query_one(PromptInput))
            assert app.query_one(ChatLog).region.height >= 5  # the last lines of the chat
            if shown:
                assert on_screen(app, app.query_one("VramBar"))
        await pilot.press("f2", *"typed")  # the focus stays in the input: not typing blind
        assert app.query_one(PromptInput).text == "typed"


@pytest.mark.parametrize("size", [SMALL, LARGE])
@async_test
async def test_f3_opens_the_flags_and_focuses_the_first_switch_in_one_press(
    tmp_path: Path, size: tuple[int, int]
) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        await wait_ready(pilot)
        await pilot.press("f3")
        await pilot.pause()
        assert isinstance(app.focused, Toggle) and app.focused.id == SWITCHES[0]
        assert on_screen(app, app.focused) and on_screen(app, app.query_one(PromptInput))
        await pilot.press("escape", "f2", "f3")  # from a hidden dashboard too
        await pilot.pause()
        assert isinstance(app.focused, Toggle) and on_screen(app, app.focused)


@async_test
async def test_each_flag_switch_is_its_own_line_with_a_visible_focus(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await wait_ready(pilot)
        await pilot.press("f3")
        await pilot.pause()
        toggles = list(app.query_one(FlagsPanel).query(Toggle))
        assert [t.id for t in toggles] == list(SWITCHES)
        assert len({t.region.y for t in toggles}) == len(SWITCHES)  # one row each
        rows = [t.render_line(0) for t in toggles]
        assert all(row.text == OFF for row in rows)
        # the first one has the focus: drawn reversed
        focused, other = (next(seg.style for seg in row if seg.text.strip()) for row in rows[:2])
        assert focused is not None and focused.reverse and not (other and other.reverse)
        await pilot.press("down", "space")  # the second switch, toggled by keyboard: refused
        assert app.focused is toggles[1]  # (no --serve) and put back
        panel = app.query_one(FlagsPanel)
        await wait_until(pilot, lambda: "refused" in panel.status.plain)
        assert not toggles[1].value and toggles[1].render_line(0).text == OFF
        with panel.prevent(Toggle.Changed):
            toggles[1].value = True
        assert toggles[1].render_line(0).text == ON


# -- footer, header ------------------------------------------------------------------------
@async_test
async def test_the_footer_keeps_help_at_80_columns(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await wait_ready(pilot)
        await pilot.pause()
        keys = {k.action: k for k in app.screen.query(FooterKey)}
        assert keys["help"].region.x == 0 and on_screen(app, keys["help"])
        for a in keys.values():  # no key drawn over another
            for b in keys.values():
                assert a is b or not a.region.overlaps(b.region)
        await pilot.click(keys["help"])
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)


def test_the_subtitle_drops_its_last_parts_before_the_title_is_cut() -> None:
    sub = "remote: http://gpu:8000 · big model · 48 layers · 128 experts (8 active)"
    assert fit_subtitle("strata chat", sub, 200) == sub
    assert fit_subtitle("strata chat", sub, 64) == "remote: http://gpu:8000 · big model · 48 layers"
    assert fit_subtitle("strata chat", sub, 10) == "remote: http://gpu:8000"


@async_test
async def test_the_header_title_fits_80_columns_and_a_remote_engine_says_so(
    tmp_path: Path,
) -> None:
    config = ChatConfig(EngineOptions(model="tiny"), LoanFlags(), connect="http://127.0.0.1:9")
    app = StrataApp(config, store=Store.open(tmp_path / "db.sqlite3"))
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        assert app.sub_title == "remote: http://127.0.0.1:9"
        title = str(app.default_screen.query_one(HeaderTitle).render())
        assert title == "strata chat — remote: http://127.0.0.1:9"
        await wait_until(pilot, lambda: bool(app.error_line))  # nothing listens there


# -- the chat's scroll ---------------------------------------------------------------------
@async_test
async def test_reopen_at_the_latest_message_and_stay_there_across_resizes(
    tmp_path: Path,
) -> None:
    conv = long_conversation()
    store = Store.open(tmp_path / "conversations.sqlite3")
    store_all(store, conv)
    store.close()
    app = make_app(tmp_path)
    async with app.run_test(size=LARGE) as pilot:
        await wait_ready(pilot)
        chat = app.query_one(ChatLog)
        assert chat.max_scroll_y > 0 and chat.is_vertical_scroll_end
        for size in (SMALL, LARGE, (100, 30)):  # the answers re-wrap: taller, shorter
            await pilot.resize_terminal(*size)
            await pilot.pause(0.3)
            assert chat.is_vertical_scroll_end, size
        chat.scroll_home(animate=False)  # the user scrolled up: a resize leaves it there
        await pilot.pause()
        await pilot.resize_terminal(*SMALL)
        await pilot.pause(0.3)
        assert chat.scroll_y == 0


# -- help ----------------------------------------------------------------------------------
@async_test
async def test_help_scrolls_by_keyboard(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await wait_ready(pilot)
        await pilot.press("f1")
        await pilot.pause()
        body = app.screen.query_one("#help-body")
        assert app.focused is body and body.max_scroll_y > 0
        await pilot.press("down")
        assert body.scroll_y == 1
        await pilot.press("pagedown")
        assert body.scroll_y > 1
        await pilot.press("end")
        assert body.scroll_y == body.max_scroll_y
        await pilot.press("home")
        assert body.scroll_y == 0
        await pilot.press("space")
        assert body.scroll_y > 1
        await pilot.press("q")
        assert not isinstance(app.screen, HelpScreen)


# -- the palette's Screenshot --------------------------------------------------------------
@async_test
async def test_screenshot_without_downloads_goes_to_the_data_folder_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"  # a home with no Downloads folder (and no user-dirs file)
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "data"))
    folder, why = screenshot_dir()
    assert folder == tmp_path / "data" / "screenshots" and "does not exist" in why
    app = make_app(tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Screenshot")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_until(pilot, lambda: any(folder.glob("*.svg")), 10)
        await wait_until(pilot, lambda: any("Saved screenshot" in n.message
                                            for n in app._notifications), 10)
        said = [n.message for n in app._notifications]
        assert any("the screenshot goes to" in m and str(folder) in m for m in said)
        assert not any("Failed" in m for m in said)
    svg = next(folder.glob("*.svg")).read_text()
    assert svg.startswith("<svg") and "strata" in svg
    (home / "Downloads").mkdir()  # once Downloads exists, it is used
    assert screenshot_dir() == (home / "Downloads", "")


# -- the event log -------------------------------------------------------------------------
@async_test
async def test_the_event_log_keeps_its_width_across_a_resize_while_hidden(
    tmp_path: Path,
) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=LARGE) as pilot:
        await wait_ready(pilot)
        log = app.query_one(EventLog)
        await pilot.resize_terminal(*SMALL)  # the dashboard, and the log, are hidden
        await pilot.pause()
        assert not app.query_one(Dashboard).display
        panel = app.query_one(FlagsPanel)
        for on in (True, False):  # refused (no --serve): a line in the log each time
            app.request_flags(panel.flags.with_changes(elastic_loan=on), panel.options)
            await pilot.pause(0.3)
        await pilot.resize_terminal(*LARGE)
        await pilot.pause(0.5)
        width = log.scrollable_content_region.width
        lines = [strip.text.rstrip() for strip in log.lines]
        assert width > 40 and any(line.startswith("flags refused") for line in lines)
        assert max(len(line) for line in lines) > 40  # not one cell a line
        assert all(len(line) <= width for line in lines)


# -- the command line ----------------------------------------------------------------------
def test_strata_version_and_the_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import version

    assert strata_main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"strata {version()}\n" and version()[0].isdigit()
    assert strata_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  strata                       open the chat app" in out
    assert "--version" in out and "chat" in out and "serve" in out


def test_strata_version_from_the_console_script() -> None:
    script = "import sys; from app.cli import main; sys.exit(main())"
    run = subprocess.run([sys.executable, "-c", script, "--version"], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("strata ") and not run.stderr
