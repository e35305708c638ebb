"""Snapshot tests at 80x24 and 160x48 (pytest-textual-snapshot, the `tiny` preset): the chat
with a reopened conversation, the help scrolled by keyboard, the flags panel after F3.

Update with `pytest tests/test_app_layout_snapshots.py --snapshot-update` after a deliberate
change, and look at the report it writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_app_store import store_all
from textual.containers import VerticalScroll
from textual.widgets import Input, TextArea

from app.app import StrataApp
from app.config import ChatConfig
from app.scenes import steady_cursor, wait_ready, wait_until
from app.screens import HelpScreen
from app.store import Store
from app.widgets.chat_log import ChatLog
from app.widgets.toggle import Toggle
from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation, Message

SIZES = [(80, 24), (160, 48)]
ANSWER = """The expert cache lends its tail to the prompt path:

- the verifier and the native head step aside
- every lent slot is refilled into the same slot

```python
chunk_tokens, ring_slots = 1024, 227
```

Then the first token is computed with the restored head."""


def reopened_app(tmp_path: Path) -> StrataApp:
    """The app on a store holding a two-exchange conversation (it reopens at the last)."""
    conv = Conversation()
    for question in ("What does the loan lend?", "And after the prompt?"):
        conv.messages += [Message("user", question), Message("assistant", ANSWER)]
    store = Store.open(tmp_path / "conversations.sqlite3")
    store_all(store, conv)
    config = ChatConfig(EngineOptions(model="tiny"), LoanFlags(), max_new=8)
    return StrataApp(config, store=store, export_dir=tmp_path / "exports")


def still(screen) -> None:  # type: ignore[no-untyped-def]
    """No blink phase in the picture: every text field of `screen`, and of the screens below
    it that a dialog shows dimmed, draws a steady cursor."""
    for shown in screen.app.screen_stack:
        for text_field in (*shown.query(Input), *shown.query(TextArea)):
            steady_cursor(text_field)


async def settled(pilot) -> None:  # type: ignore[no-untyped-def]
    """Ready, the reopened chat at its end and every Markdown block laid out."""
    await wait_ready(pilot)
    chat = pilot.app.query_one(ChatLog)
    await wait_until(pilot, lambda: chat.virtual_size.height > 20 and chat.is_vertical_scroll_end)
    await pilot.wait_for_scheduled_animations()
    await pilot.pause(0.5)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_chat(size: tuple[int, int], snap_compare, tmp_path: Path) -> None:
    assert snap_compare(reopened_app(tmp_path), terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help_scrolled_by_keyboard(size: tuple[int, int], snap_compare, tmp_path: Path) -> None:
    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        await settled(pilot)
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen))
        body = pilot.app.screen.query_one("#help-body", VerticalScroll)
        # the help laid out (Markdown mounts its blocks later) and focused
        await wait_until(pilot, lambda: body.max_scroll_y > body.size.height and body.has_focus)
        still(pilot.app.screen)
        await pilot.press("pagedown", "down")
        await wait_until(pilot, lambda: body.scroll_y == body.size.height + 1)  # a page, a line
        await pilot.wait_for_scheduled_animations()
        await pilot.pause(0.3)

    assert snap_compare(reopened_app(tmp_path), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_flags_panel(size: tuple[int, int], snap_compare, tmp_path: Path) -> None:
    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        await settled(pilot)
        await pilot.press("f3")
        await wait_until(pilot, lambda: isinstance(pilot.app.focused, Toggle))
        await pilot.pause(0.5)  # the scroll follows the dashboard's second layout

    assert snap_compare(reopened_app(tmp_path), terminal_size=size, run_before=run_before)
