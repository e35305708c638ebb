"""A long history across resizes (issue 28 item 6): only the messages near the view are laid
out, the message at the top of the view stays there, the end of the chat stays at the end, and
every message scrolled to is laid out whole, as tall as a fresh layout at that size makes it.
Pilot tests on the `tiny` preset; no timing (docs/app-layout.md has the measurement)."""

from __future__ import annotations

from pathlib import Path

from test_app_flows import async_test, make_app
from test_app_store import store_all

from app.bench_resize import PARAGRAPH
from app.scenes import wait_ready
from app.store import Store
from app.widgets.chat_log import ChatLog, MessageView
from engine.request.conversation import Conversation, Message

SMALL, MIDDLE, LARGE = (80, 24), (120, 40), (160, 48)
N_EXCHANGES = 24


def answer(i: int) -> str:
    """A multi-paragraph Markdown answer whose height depends on the width."""
    return (f"## Answer {i}\n\n{PARAGRAPH * 2}\n\n- a point with `code`\n- another point, "
            f"{PARAGRAPH}\n\n```python\ndef f(x):\n    return x + {i}\n```\n\n"
            f"{PARAGRAPH * 3}\n\n> a quote: {PARAGRAPH}")


def long_history() -> Conversation:
    conv = Conversation()
    for i in range(N_EXCHANGES):
        conv.messages.append(Message("user", f"question {i}"))
        conv.messages.append(Message("assistant", answer(i)))
    return conv


def opened_with(tmp_path: Path, conv: Conversation):
    store = Store.open(tmp_path / "conversations.sqlite3")
    store_all(store, conv)
    store.close()
    return make_app(tmp_path)  # reopens the last conversation


def state(chat: ChatLog) -> tuple:
    return (chat.scroll_y, chat.virtual_size, tuple(v.folded for v in chat.views),
            tuple(v.outer_size for v in chat.views))


async def settle(pilot, chat: ChatLog) -> None:
    """Pause until the log's scroll, height and folds stop changing."""
    before = None
    for _ in range(200):
        await pilot.pause(0.05)
        now = state(chat)
        if now == before:
            return
        before = now
    raise TimeoutError("the chat log did not settle")


def top_message(chat: ChatLog) -> MessageView:
    """The message at the top of the view (its laid-out region holds the view's first line)."""
    y = chat.scroll_y
    return next(v for v in chat.views if v.virtual_region_with_margin.bottom > y)


def in_view(chat: ChatLog) -> list[MessageView]:
    top, bottom = chat.scroll_y, chat.scroll_y + chat.scrollable_content_region.height
    return [v for v in chat.views
            if v.virtual_region.y < bottom and v.virtual_region.bottom > top]


def assert_in_view_laid_out(chat: ChatLog) -> None:
    shown = in_view(chat)
    assert shown and not [v for v in shown if v.folded], [chat.views.index(v) for v in shown]
    for view in shown:  # its children are in the layout: the body has its lines
        assert view.outer_size.height >= 2 and all(c.display for c in view.children
                                                   if not c.has_class("status"))


@async_test
async def test_a_resize_keeps_the_end_and_lays_out_only_what_is_near(tmp_path: Path) -> None:
    app = opened_with(tmp_path, long_history())
    async with app.run_test(size=MIDDLE) as pilot:
        await wait_ready(pilot)
        chat = app.query_one(ChatLog)
        await settle(pilot, chat)
        assert len(chat.views) == 2 * N_EXCHANGES and chat.is_vertical_scroll_end
        assert len(chat.laid_out) < len(chat.views) // 4  # the far ones are folded
        for size in (SMALL, LARGE, SMALL, MIDDLE):
            await pilot.resize_terminal(*size)
            await settle(pilot, chat)
            assert chat.is_vertical_scroll_end, size
            assert chat.views[-1] in in_view(chat), size
            assert_in_view_laid_out(chat)
            assert len(chat.laid_out) < len(chat.views) // 4, size


@async_test
async def test_a_resize_keeps_the_message_at_the_top_of_the_view(tmp_path: Path) -> None:
    app = opened_with(tmp_path, long_history())
    async with app.run_test(size=MIDDLE) as pilot:
        await wait_ready(pilot)
        chat = app.query_one(ChatLog)
        await settle(pilot, chat)
        target = chat.views[21]  # an answer in the middle, folded while the chat is at its end
        assert target.folded
        chat.scroll_to_widget(target, top=True, animate=False)
        await settle(pilot, chat)
        assert top_message(chat) is target and not target.folded
        assert target.virtual_region.y == chat.scroll_y  # its first line at the view's top
        assert_in_view_laid_out(chat)
        for size in (SMALL, LARGE, (100, 30), MIDDLE):  # each re-wraps every answer
            await pilot.resize_terminal(*size)
            await settle(pilot, chat)
            assert top_message(chat) is target, (size, chat.views.index(top_message(chat)))
            assert target.virtual_region.y == chat.scroll_y, size
            assert not chat.is_vertical_scroll_end
            assert_in_view_laid_out(chat)
        # halfway down a message: still halfway down it after a resize (within a line or two
        # of the same share of its height)
        chat.scroll_to(y=target.virtual_region.y + target.outer_size.height // 2,
                       animate=False)
        await settle(pilot, chat)
        share = (chat.scroll_y - target.virtual_region.y) / target.outer_size.height
        await pilot.resize_terminal(*LARGE)
        await settle(pilot, chat)
        assert top_message(chat) is target
        after = (chat.scroll_y - target.virtual_region.y) / target.outer_size.height
        assert abs(after - share) <= 2 / target.outer_size.height, (share, after)


@async_test
async def test_after_a_resize_every_message_scrolled_to_is_laid_out_whole(
        tmp_path: Path) -> None:
    conv = long_history()
    fresh = opened_with(tmp_path / "fresh", conv)
    async with fresh.run_test(size=SMALL) as pilot:  # laid out at this size from the start
        await wait_ready(pilot)
        chat = fresh.query_one(ChatLog)
        await settle(pilot, chat)
        fresh_heights = [v.outer_size.height for v in chat.views]
        fresh_height = chat.virtual_size.height
    app = opened_with(tmp_path / "resized", conv)
    async with app.run_test(size=LARGE) as pilot:
        await wait_ready(pilot)
        chat = app.query_one(ChatLog)
        await settle(pilot, chat)
        await pilot.resize_terminal(*SMALL)  # the far messages' heights are estimates now
        await settle(pilot, chat)
        chat.scroll_home(animate=False)
        await settle(pilot, chat)
        assert top_message(chat) is chat.views[0]
        laid_out: set[int] = set()
        while True:  # down the whole log, two views at a time (what is near is laid out)
            assert_in_view_laid_out(chat)
            laid_out.update(i for i, v in enumerate(chat.views) if not v.folded)
            if chat.is_vertical_scroll_end:
                break
            chat.scroll_relative(y=2 * chat.scrollable_content_region.height, animate=False)
            await settle(pilot, chat)
        assert laid_out == set(range(len(chat.views)))
        # each was laid out at this width on the way: as tall as in the fresh app
        assert [v.outer_size.height for v in chat.views] == fresh_heights
        assert chat.virtual_size.height == fresh_height
