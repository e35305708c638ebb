"""Chat actions: copy a message or a code block (OSC 52), regenerate, edit and send again,
Up/Down prompt history. The pilot drives the app on the real engine (`tiny` preset) and a real
SQLite store; the pure parts (code blocks, the history's walk, the store's cut) are tested
alone first."""

from __future__ import annotations

import base64
from pathlib import Path

from gates import Gate
from test_app_flows import SIZE, async_test, make_app, reference_reply, send
from textual.notifications import Notify

from app.chat_actions import (
    COPY_MAX_CHARS,
    CodeBlock,
    code_blocks,
    copy_notice,
    copy_refusal,
    cut,
    put_back,
)
from app.draft import Draft
from app.prompt_history import PromptHistory
from app.scenes import wait_ready, wait_until
from app.store import Store
from app.widgets.chat_log import MessageView
from app.widgets.prompt_input import Composer
from engine.request.conversation import Conversation, Message
from engine.trace.events import RequestDone, RequestStarted

ANSWER_WITH_CODE = (
    "Two ways:\n\n```python\nprint(1)\n```\n\n- or in a list:\n\n  ```sh\n  ls -l\n  ```\n"
)


# -- pure parts -------------------------------------------------------------------------------
def test_code_blocks_are_found_in_order_with_their_language() -> None:
    assert code_blocks(ANSWER_WITH_CODE) == [CodeBlock("print(1)\n", "python"),
                                             CodeBlock("ls -l\n", "sh")]
    assert code_blocks("no code, `inline` only") == []
    assert code_blocks("~~~\nraw\n~~~") == [CodeBlock("raw\n", "")]
    assert code_blocks("```\nnever closed") == [CodeBlock("never closed", "")]  # mid-answer


def test_copy_is_refused_when_empty_or_too_long_and_the_notice_says_how() -> None:
    assert copy_refusal("x", "answer") == ""
    assert "no text yet" in copy_refusal("", "answer")
    refused = copy_refusal("x" * (COPY_MAX_CHARS + 1), "answer")
    assert f"{COPY_MAX_CHARS + 1:,} characters" in refused and "ctrl+s" in refused
    first, warn = copy_notice(1234, "answer", first=True, env={})
    assert first.startswith("Copied the answer: 1,234 characters.") and "OSC 52" in first
    assert not warn and "tmux" not in first
    assert "set-clipboard on" in copy_notice(5, "answer", first=True, env={"TMUX": "/t"})[0]
    assert copy_notice(5, "answer", first=False, env={}) == (
        "Copied the answer: 5 characters.", False)
    apple, warn = copy_notice(5, "answer", first=False, env={"TERM_PROGRAM": "Apple_Terminal"})
    assert warn and "macOS Terminal" in apple


def test_history_walks_newest_first_and_keeps_the_draft_and_changes() -> None:
    loads: list[int] = []

    def load() -> list[str]:
        loads.append(1)
        return ["newest", "older", "oldest"]

    history = PromptHistory(load)
    assert loads == [] and history.newer(Draft("x")) is None  # not browsing: nothing loaded
    draft = Draft("half a thought", ((3, "pasted"),))
    assert history.older(draft) == "newest" and loads == [1]
    assert history.older(Draft("newest")) == "older"
    assert history.newer(Draft("older, changed")) == Draft("newest")  # as it was left
    assert history.older(Draft("newest")) == Draft("older, changed")  # the change kept
    assert history.older(Draft("older, changed")) == "oldest"
    assert history.older(Draft("oldest")) is None  # the oldest: stays
    assert history.newer(Draft("oldest")) == Draft("older, changed")
    assert history.newer(Draft("older, changed")) == Draft("newest")
    assert history.newer(Draft("newest")) == draft  # the draft, chips and all
    assert not history.browsing and history.newer(draft) is None
    history.sent("older")  # sent again: the newest, once; changes forgotten
    assert history.entries == ["older", "newest", "oldest"] and loads == [1]
    assert history.older(Draft("")) == "older"


def test_cut_and_put_back_restore_the_conversation_and_its_title() -> None:
    conv = Conversation()
    for role, text in [("user", "first"), ("assistant", "a"), ("user", "second"),
                       ("assistant", "b")]:
        conv.add(role, text)
    before = list(conv.messages)
    dropped = cut(conv, 2)
    assert [m.content for m in conv.messages] == ["first", "a"] and conv.title == "first"
    put_back(conv, dropped)
    assert conv.messages == before
    dropped = cut(conv, 0)
    assert conv.messages == [] and conv.title == ""
    put_back(conv, dropped)
    assert conv.messages == before and conv.title == "first"


def test_store_truncate_keeps_the_first_messages_in_reading_order(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "c.sqlite3")
    conv = Conversation()
    seqs = []
    for role, text in [("user", "first"), ("assistant", "a"), ("user", "second"),
                       ("assistant", "b")]:
        reply_to = seqs[-1] if role == "assistant" else None
        seqs.append(store.append(conv, Message(role, text), reply_to))
    store.truncate(conv.id, 2)
    assert [m.content for m in store.load(conv.id).messages] == ["first", "a"]
    store.append(conv, Message("user", "third"))  # the next seq follows what is left
    assert [m.content for m in store.load(conv.id).messages] == ["first", "a", "third"]
    store.truncate(conv.id, 3)  # nothing after the third: nothing removed
    assert len(store.load(conv.id).messages) == 3
    store.truncate(conv.id, 0)  # nothing left: the conversation goes, as a withdraw's does
    assert store.load(conv.id) is None and store.list() == []


def test_store_prompt_history_is_newest_first_distinct_and_bounded(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "c.sqlite3")
    a, b = Conversation(), Conversation()
    t = 1000.0
    for conv, role, text in [(a, "user", "one"), (a, "assistant", "answer"),
                             (b, "user", "two"), (a, "user", "one"), (b, "user", "   "),
                             (b, "user", "x" * 50), (a, "user", "three")]:
        t += 1
        store.append(conv, Message(role, text, created=t))
    assert store.prompt_history() == ["three", "x" * 50, "one", "two"]
    assert store.prompt_history(n_prompts=2) == ["three", "x" * 50]
    # past the character budget a long prompt is skipped, the shorter ones still fit
    assert store.prompt_history(max_chars=20) == ["three", "one", "two"]


# -- the app ------------------------------------------------------------------------------------
def store_conversation(path: Path, *pairs: tuple[str, str]) -> Conversation:
    """A conversation written to the store at `path` before the app starts (it opens it)."""
    store = Store.open(path)
    conv = Conversation()
    for prompt, answer in pairs:
        seq = store.append(conv, Message("user", prompt))
        store.append(conv, Message("assistant", answer), reply_to=seq)
    store.close()
    return conv


def toasts(notes: list[object]) -> list[str]:
    return [n.notification.message for n in notes if isinstance(n, Notify)]


@async_test
async def test_copy_writes_osc52_and_copies_code_blocks_one_by_one(tmp_path: Path) -> None:
    store_conversation(tmp_path / "conversations.sqlite3", ("show me", ANSWER_WITH_CODE))
    app = make_app(tmp_path)
    notes: list[object] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        written: list[str] = []
        write = app._driver.write  # what reaches the terminal, recorded on its way

        def record(data: str) -> None:
            written.append(data)
            write(data)

        app._driver.write = record
        await pilot.press("ctrl+up")
        answer = app.query(MessageView).last()
        assert app.focused is answer
        await pilot.press("y")
        assert app.clipboard == ANSWER_WITH_CODE
        osc52 = f"\x1b]52;c;{base64.b64encode(ANSWER_WITH_CODE.encode()).decode()}\a"
        assert osc52 in written
        said = toasts(notes)[-1]
        assert said.startswith(f"Copied the answer: {len(ANSWER_WITH_CODE):,} characters.")
        assert "OSC 52" in said  # the first copy says how it travels
        await pilot.press("c")
        assert toasts(notes)[-1] == f"Copied the answer: {len(ANSWER_WITH_CODE):,} characters."
        for expected in ("ls -l\n", "print(1)\n", "ls -l\n"):  # the last block first, round
            await pilot.press("b")
            assert app.clipboard == expected
        assert "code block 1 of 2 (1 line, python)" in toasts(notes)[-2]
        await pilot.press("down")  # past the last message: back to the input
        assert app.focused is app.query_one(Composer).input
        await pilot.press("ctrl+up", "up")
        assert app.focused is app.query(MessageView).first()
        await pilot.press("y")
        assert app.clipboard == "show me"
        assert f"\x1b]52;c;{base64.b64encode(b'show me').decode()}\a" in written
        await pilot.press("b")  # a message with no code block: the key does nothing
        assert app.clipboard == "show me"
        await pilot.press("x")  # typing elsewhere still goes to the input
        assert app.query_one(Composer).input.text == "x"


def request_dones(app) -> list[RequestDone]:
    dones: list[RequestDone] = []
    app.link.bus.subscribe(lambda e: dones.append(e) if isinstance(e, RequestDone) else None)
    return dones


@async_test
async def test_regenerate_replaces_the_last_answer_and_reuses_the_prompt(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    dones = request_dones(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "hello")
        await send(pilot, "again")
        first = list(app.conv.messages)
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: len(dones) == 3 and not app.running)
        done = dones[-1]
        assert not done.cancelled
        # the same prompt again: everything but its last token comes from the KV cache
        assert done.reused_tokens == done.prompt_tokens - 1 and done.fresh_tokens == 1
        assert [m.content for m in app.conv.messages[:3]] == [m.content for m in first[:3]]
        assert len(app.conv.messages) == 4
        assert app.conv.messages[3] is not first[3]
        assert app.conv.messages[3].content == reference_reply(["hello", "again"])
        assert [v.content for v in app.query(MessageView)] == [
            m.content for m in app.conv.messages]
        saved = app.store.load(app.conv.id)
        assert [m.content for m in saved.messages] == [m.content for m in app.conv.messages]
        # r on the first answer: its prompt again, the exchange after it dropped
        app.query(MessageView)[1].focus()
        await pilot.press("r")
        await wait_until(pilot, lambda: len(dones) == 4 and not app.running)
        assert [m.content for m in app.conv.messages] == ["hello", reference_reply(["hello"])]
        assert len(app.store.load(app.conv.id).messages) == 2
        assert dones[-1].reused_tokens > 0


@async_test
async def test_edit_and_resend_drops_what_follows_and_reuses_the_prefix(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    dones = request_dones(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "hello")
        await send(pilot, "world")
        composer = app.query_one(Composer)
        await pilot.press(*"my draft")
        await pilot.press("ctrl+up", "up", "e")  # the last answer, the prompt above it: edit
        target = composer.editing
        assert target is not None and (target.index, target.n_after) == (2, 1)
        assert composer.input.text == "world"
        assert "editing message 3" in str(composer.query_one("#editing").render())
        await pilot.press(*["backspace"] * 5, *"there", "enter")
        await wait_until(pilot, lambda: len(dones) == 3 and not app.running)
        assert [m.content for m in app.conv.messages] == [
            "hello", reference_reply(["hello"]), "there", reference_reply(["hello", "there"])]
        saved = app.store.load(app.conv.id)
        assert [m.content for m in saved.messages] == [m.content for m in app.conv.messages]
        done = dones[-1]
        # the first exchange came from the KV cache; the edited message was read fresh
        assert done.reused_tokens > 0 and done.fresh_tokens > 1
        assert done.reused_tokens + done.fresh_tokens == done.prompt_tokens
        assert done.fresh_tokens < dones[1].fresh_tokens + dones[1].generated
        assert composer.editing is None
        assert composer.input.text == "my draft"  # what the input held before the edit
        assert [v.content for v in app.query(MessageView)] == [
            m.content for m in app.conv.messages]


@async_test
async def test_escape_stops_editing_and_the_draft_comes_back(tmp_path: Path) -> None:
    store_conversation(tmp_path / "conversations.sqlite3", ("hello", "hi"))
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        await pilot.press(*"draft", "ctrl+up")
        assert app.focused is app.query(MessageView).last()
        await pilot.press("e")  # on the answer: its prompt
        assert composer.editing.index == 0 and composer.input.text == "hello"
        assert app.focused is composer.input
        await pilot.press("escape")
        assert composer.editing is None and composer.input.text == "draft"
        assert [m.content for m in app.conv.messages] == ["hello", "hi"]
        assert len(app.store.load(app.conv.id).messages) == 2


@async_test
async def test_a_regenerate_cancelled_before_any_text_puts_the_answer_back(
        tmp_path: Path) -> None:
    app = make_app(tmp_path)
    dones = request_dones(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "hello")
        before = [m.content for m in app.conv.messages]
        gate = Gate(app.link.bus, lambda e: isinstance(e, RequestStarted))
        app.simulate_key("ctrl+r")  # pilot.press would wait for the held request
        await wait_until(pilot, gate.reached.is_set)
        await pilot.press("escape")
        gate.release()
        await wait_until(pilot, lambda: len(dones) == 2 and not app.running)
        assert dones[-1].cancelled
        assert [m.content for m in app.conv.messages] == before
        assert [v.content for v in app.query(MessageView)] == before
        assert [m.content for m in app.store.load(app.conv.id).messages] == before
        assert app.query_one(Composer).input.text == ""  # a regenerate typed nothing


@async_test
async def test_up_and_down_walk_the_prompts_of_every_conversation(tmp_path: Path) -> None:
    store_conversation(tmp_path / "conversations.sqlite3", ("stored", "answer"))
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "first")
        await pilot.press("ctrl+n")
        await send(pilot, "second")
        await pilot.press("ctrl+n")
        prompt = app.query_one(Composer).input
        await pilot.press("a", "ctrl+j", "b")
        await pilot.press("up")  # the cursor on the second line: it moves up, no recall
        assert prompt.text == "a\nb" and prompt.cursor_location[0] == 0
        seen = []
        for _ in range(4):  # the last press, at the oldest, changes nothing
            await pilot.press("up")
            seen.append(prompt.text)
        assert seen == ["second", "first", "stored", "stored"]
        await pilot.press("down", "down")
        assert prompt.text == "second"
        await pilot.press("down")
        assert prompt.text == "a\nb"  # the draft at the bottom
        await pilot.press("down")
        assert prompt.text == "a\nb"


@async_test
async def test_the_palette_copies_the_last_answer_and_regenerates(tmp_path: Path) -> None:
    store_conversation(tmp_path / "conversations.sqlite3", ("show me", ANSWER_WITH_CODE))
    app = make_app(tmp_path)
    dones = request_dones(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        for query, done in (("copy the last code", lambda: app.clipboard == "ls -l\n"),
                            ("regenerate the last", lambda: len(dones) == 1 and not app.running)):
            await pilot.press("ctrl+p", *query)
            await pilot.pause(0.3)
            await pilot.press("enter")
            await wait_until(pilot, done)
        assert [m.content for m in app.conv.messages] == ["show me", reference_reply(["show me"])]
