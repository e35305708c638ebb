"""Nothing a user wrote is lost: prompts stored when sent, cancelled answers kept, two instances
on one database, a kill -9 mid-request, unusable databases. Pilot tests on the `tiny` preset."""

from __future__ import annotations

import os
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_app_flows import MAX_NEW, SIZE, Gate, async_test, make_app, send
from test_app_store import run_read_only
from textual.notifications import Notify
from textual.widgets import Label, Markdown

from app.app import RETRY_S, StrataApp
from app.config import ChatConfig
from app.main import run_app
from app.scenes import wait_ready, wait_until
from app.store import DB_NAME, SCHEMA_VERSION, Store
from app.widgets.chat_log import SHOWN_CHARS, ChatLog, MessageView, ShowAll
from app.widgets.prompt_input import Composer, PromptInput
from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation, Message
from engine.runtime.serve import ServeLoop
from engine.trace.events import Event, EventBus, PrefillProgress, Token

ROOT = Path(__file__).resolve().parents[1]


def stored(tmp_path: Path) -> list[tuple]:
    """(role, content, cancelled, reply_to) of every stored message, read by another reader."""
    db = sqlite3.connect(tmp_path / DB_NAME)
    try:
        return db.execute(
            "SELECT role, content, cancelled, reply_to FROM messages ORDER BY seq"
        ).fetchall()
    finally:
        db.close()


def answer_after(conv: Conversation, prompt: str) -> str:
    """What a separate engine answers to `prompt` after the messages of `conv`."""
    return ServeLoop.create(EngineOptions(model="tiny")).chat(conv, prompt, max_new=MAX_NEW).text


def label(view: MessageView) -> str:
    return str(view.query_one(Label).render())


@async_test
async def test_the_prompt_is_stored_when_sent_before_the_answer(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    gate = Gate(app.link.bus, lambda e: isinstance(e, PrefillProgress))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press(*"remember me", "enter")
        await wait_until(pilot, gate.reached.is_set)
        assert app.running
        assert stored(tmp_path) == [("user", "remember me", 0, None)]
        gate.release()
        await wait_until(pilot, lambda: not app.running)
        answer = app.conv.messages[1].content
        assert stored(tmp_path) == [("user", "remember me", 0, None), ("assistant", answer, 0, 0)]


APP_KILLED_MID_REQUEST = """
    import asyncio, os, sys, threading
    from pathlib import Path
    from app.app import StrataApp
    from app.config import ChatConfig
    from app.scenes import wait_ready
    from app.store import DB_NAME, Store
    from engine.config import EngineOptions, LoanFlags
    from engine.trace.events import PrefillProgress

    config = ChatConfig(EngineOptions(model="tiny"), LoanFlags(), max_new=8)
    app = StrataApp(config, store=Store.open(Path(sys.argv[1]) / DB_NAME))
    held = threading.Event()

    def hold(event):  # the engine thread stops in the prefill; say so, then wait for the kill
        if isinstance(event, PrefillProgress):
            os.write(1, b"prefilling\\n")
            held.wait()

    app.link.bus.subscribe(hold)

    async def main():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_ready(pilot)
            await pilot.press(*"do not lose me", "enter")
            await asyncio.sleep(120)

    asyncio.run(main())
"""


def test_kill_9_during_a_request_keeps_the_prompt(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(APP_KILLED_MID_REQUEST), str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the app did not start its request in 120 s"
        line = proc.stdout.readline()
        assert line == b"prefilling\n", line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert stored(tmp_path) == [("user", "do not lose me", 0, None)]
    conv = Store.open(tmp_path / DB_NAME).last()
    assert conv is not None and conv.title == "do not lose me"


@async_test
async def test_esc_after_some_text_keeps_the_answer_marked_cancelled(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    gate = Gate(app.link.bus, lambda e: isinstance(e, Token))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press(*"hello", "enter")
        await wait_until(pilot, gate.reached.is_set)
        await pilot.press("escape")
        gate.release()
        await wait_until(pilot, lambda: not app.running)
        _, answer = app.conv.messages
        full = answer_after(Conversation(), "hello")
        assert answer.cancelled and answer.content and full.startswith(answer.content)
        assert len(answer.content) < len(full), "the answer finished before the cancel"
        view = app.query(MessageView).last()
        assert view.content == answer.content and view.has_class("-cancelled")
        assert "cancelled" in label(view)
        assert app.query_one(PromptInput).text == ""  # the prompt is in the log, not put back
        assert stored(tmp_path) == [("user", "hello", 0, None), ("assistant", answer.content, 1, 0)]
        # the user saw the partial answer: the next prompt's context includes it
        await send(pilot, "go on")
        kept = Conversation()
        kept.add("user", "hello")
        kept.add("assistant", answer.content, cancelled=True)
        assert app.conv.messages[-1].content == answer_after(kept, "go on")
    again = make_app(tmp_path)  # reopened: still there, still marked
    async with again.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        views = list(again.query(MessageView))
        assert [v.content for v in views[:2]] == ["hello", answer.content]
        assert views[1].has_class("-cancelled") and "cancelled" in label(views[1])
        assert not views[3].has_class("-cancelled")


@async_test
async def test_a_prompt_cancelled_before_any_text_is_not_the_title(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    gate = Gate(app.link.bus, lambda e: isinstance(e, PrefillProgress))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press(*"never mind", "enter")
        await wait_until(pilot, gate.reached.is_set)
        await pilot.press("escape")
        gate.release()
        await wait_until(pilot, lambda: not app.running)
        composer = app.query_one(Composer)
        assert composer.input.text == "never mind"  # back in the input, not in the conversation
        assert app.conv.messages == [] and app.conv.title == ""
        assert stored(tmp_path) == [] and app.store.list() == []
        composer.clear()
        await pilot.pause()
        await send(pilot, "the real question")
        assert app.conv.title == "the real question"
        (info,) = app.store.list()
        assert info.title == "the real question" and info.n_messages == 2


def test_a_prefill_cancel_leaves_the_conversation_untitled() -> None:
    conv = Conversation()
    conv.add("user", "first words")
    conv.pop()
    assert conv.title == ""
    conv.add("user", "second words")
    assert conv.title == "second words"


def test_the_engine_keeps_a_partial_answer_in_the_conversation() -> None:
    bus = EventBus()
    loop = ServeLoop.create(EngineOptions(model="tiny"), bus=bus)
    armed = [True]  # cancel the first request at its first text

    def cancel_at_first_text(event: Event) -> None:
        if armed and isinstance(event, Token):
            armed.clear()
            loop.cancel()

    bus.subscribe(cancel_at_first_text)
    conv = Conversation()
    reply = loop.chat(conv, "hello", max_new=MAX_NEW)
    assert reply.cancelled and reply.text and not reply.withdrawn
    assert [(m.role, m.content, m.cancelled) for m in conv.messages] == [
        ("user", "hello", False), ("assistant", reply.text, True)]
    loop.rt.check_integrity()
    # the rolled-back KV is reused correctly: the same answer as a fresh engine's
    follow = loop.chat(conv, "go on", max_new=MAX_NEW).text
    fresh = Conversation(messages=list(conv.messages[:2]))
    assert follow == answer_after(fresh, "go on")


@async_test
async def test_another_instance_s_messages_are_kept_and_taken_in(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "from here")
        other = Store.open(tmp_path / DB_NAME)  # a second app on the same data directory
        theirs = other.last()
        assert theirs is not None and theirs.id == app.conv.id
        seq = other.append(theirs, Message("user", "from there"))
        other.append(theirs, Message("assistant", "their answer"), reply_to=seq)
        await pilot.press(*"again", "enter")
        await wait_until(pilot, lambda: not app.running and app.conv.messages[-2].content == "again")
        first_answer = app.conv.messages[1].content
        contents = ["from here", first_answer, "from there", "their answer", "again"]
        assert [m.content for m in app.conv.messages[:5]] == contents
        assert [v.content for v in app.query(MessageView)][:5] == contents
        assert [r[1] for r in stored(tmp_path)][:5] == contents and len(stored(tmp_path)) == 6
        assert [m.content for m in other.load(theirs.id).messages] == [
            m.content for m in app.conv.messages]
        context = Conversation(messages=[Message("user", "from here"),
                                         Message("assistant", first_answer),
                                         Message("user", "from there"),
                                         Message("assistant", "their answer")])
        assert app.conv.messages[-1].content == answer_after(context, "again")


@async_test
async def test_quitting_mid_answer_keeps_what_was_shown(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    gate = Gate(app.link.bus, lambda e: isinstance(e, Token))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            await pilot.press(*"hello", "enter")
            await wait_until(pilot, lambda: bool(app.query_one(ChatLog).partial))
            shown = app.query_one(ChatLog).partial
            await pilot.press("ctrl+q")
            gate.release()
    finally:
        gate.release()
    assert stored(tmp_path) == [("user", "hello", 0, None), ("assistant", shown, 1, 0)]


def test_a_data_directory_that_is_a_file_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(StrataApp, "run", lambda self: pytest.fail("the app started"))
    (tmp_path / "data").write_text("a file")
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "data"))
    assert run_app(["--model", "tiny", "--plain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("strata: error: data directory")
    assert "is a file" in err


def test_a_database_from_a_newer_app_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(StrataApp, "run", lambda self: pytest.fail("the app started"))
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path))
    store = Store.open(tmp_path / DB_NAME)
    store.db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION + 1,))
    store.close()
    assert run_app(["--model", "tiny", "--plain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is newer than this app" in err
    assert (tmp_path / DB_NAME).exists() and not list(tmp_path.glob("*.bad-*"))


@async_test
async def test_a_write_refused_by_a_lock_waits_and_goes_with_the_next_message(
    tmp_path: Path,
) -> None:
    app = make_app(tmp_path)
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        app.store.db.execute("PRAGMA busy_timeout = 50")
        holder = sqlite3.connect(tmp_path / DB_NAME)
        holder.execute("BEGIN IMMEDIATE")  # another writer that does not let go
        await send(pilot, "hello")
        assert said(notes, "Not saved yet") == [
            f"{n} message(s) wait in memory: {tmp_path / DB_NAME}: database is locked. They are "
            f"written when the database takes them (tried every {RETRY_S:.0f} s)."
            for n in (1, 2)]  # the prompt, then the answer
        assert app.query(MessageView).last().content == app.conv.messages[1].content
        holder.rollback()
        holder.close()
        await send(pilot, "again")  # the database is free again: what waited goes first
        assert said(notes, "Saved") == ["The 2 message(s) that waited are saved."]
        assert stored(tmp_path) == [
            ("user", "hello", 0, None), ("assistant", app.conv.messages[1].content, 0, 0),
            ("user", "again", 0, None), ("assistant", app.conv.messages[3].content, 0, 2)]


def said(notes: list, title: str) -> list[str]:
    return [n.notification.message for n in notes
            if isinstance(n, Notify) and n.notification.title == title]


@async_test
async def test_an_exchange_made_while_the_disk_is_full_is_written_when_it_has_room(
    tmp_path: Path
) -> None:
    app = make_app(tmp_path)
    notes: list[Notify] = []
    prompt = ("a prompt too long for the pages left " * 200).strip()  # sent messages are tidied
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        db = app.store.db
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's disk-full path: SQLITE_FULL
        app.query_one(PromptInput).insert(prompt)
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.running and len(app.conv.messages) == 2)
        app._retry_saves()  # what the timer does every RETRY_S: still full
        assert stored(tmp_path) == []
        (first, second) = said(notes, "Not saved yet")
        assert first.startswith("1 message(s) wait") and second.startswith("2 message(s) wait")
        assert "database or disk is full" in second
        db.execute("PRAGMA max_page_count = 1073741823")  # room again: the next retry writes
        app._retry_saves()
        await pilot.pause()
        assert said(notes, "Saved") == ["The 2 message(s) that waited are saved."]
    assert stored(tmp_path) == [("user", prompt, 0, None),
                                ("assistant", app.conv.messages[1].content, 0, 0)]


# -- an answer streaming when the app is killed or told to quit ----------------------------
APP_STREAMING = """
    import asyncio, os, sys, threading
    from pathlib import Path
    from app.app import StrataApp
    from app.config import ChatConfig
    from app.scenes import wait_ready
    from app.store import DB_NAME, Store
    from engine.config import EngineOptions, LoanFlags
    from engine.trace.events import Token

    config = ChatConfig(EngineOptions(model="tiny"), LoanFlags(), max_new=8)
    app = StrataApp(config, store=Store.open(Path(sys.argv[1]) / DB_NAME))
    held, n_texts = threading.Event(), [0]

    def hold(event):  # the engine thread stops after two tokens of text, until the signal
        if isinstance(event, Token) and event.text:
            n_texts[0] += 1
            if n_texts[0] == 2:
                os.write(1, b"streaming\\n")
                held.wait(60)

    app.link.bus.subscribe(hold)

    async def main():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_ready(pilot)
            await pilot.press(*"tell me a story", "enter")
            while app.is_running:
                await asyncio.sleep(0.05)
        held.set()
        print("exited", app.return_code, flush=True)

    asyncio.run(main())
"""


def with_partial(tmp_path: Path) -> list[tuple]:
    """(role, content, cancelled, reply_to, partial) of every stored message."""
    db = sqlite3.connect(tmp_path / DB_NAME)
    try:
        return db.execute("SELECT role, content, cancelled, reply_to, partial FROM messages "
                          "ORDER BY seq").fetchall()
    finally:
        db.close()


def streaming_app(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A child app whose answer has streamed some text, stored as a partial row (its text)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(APP_STREAMING), str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready and proc.stdout.readline() == b"streaming\n", proc.stderr.read1()
    rows: list[tuple] = []
    for _ in range(200):  # the app writes what it shows every PARTIAL_SAVE_S
        rows = with_partial(tmp_path)
        if len(rows) == 2:
            break
        time.sleep(0.05)
    prompt, answer = rows
    assert prompt == ("user", "tell me a story", 0, None, 0)
    assert answer[0] == "assistant" and answer[2:] == (0, 0, 1) and answer[1]
    return proc, answer[1]


def test_kill_9_mid_answer_keeps_the_answer_so_far_marked_interrupted(tmp_path: Path) -> None:
    proc, text = streaming_app(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    full = answer_after(Conversation(), "tell me a story")
    assert full.startswith(text) and len(text) < len(full)
    assert with_partial(tmp_path)[1] == ("assistant", text, 0, 0, 1)

    @async_test
    async def reopened() -> None:  # the next start shows it as an interrupted answer
        app = make_app(tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            _, view = app.query(MessageView)
            assert view.content == text and "interrupted" in label(view)
            assert view.has_class("-cancelled")
            assert app.conv.messages[1].interrupted

    reopened()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_mid_answer_saves_it_and_exits_cleanly(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc, text = streaming_app(tmp_path)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == b"exited 0\n", err
    (_, answer) = with_partial(tmp_path)
    assert answer[0] == "assistant" and answer[2:] == (1, 0, 0)  # cancelled, complete
    assert answer[1].startswith(text)
    assert answer_after(Conversation(), "tell me a story").startswith(answer[1])


# -- what the store cannot be trusted with -------------------------------------------------
@async_test
async def test_wrong_types_and_a_huge_message_are_drawn_truncated_with_show_all(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / DB_NAME)
    conv = Conversation()
    huge = "".join(f"paragraph {i}: {'word ' * 80}\n\n" for i in range(250))  # 100 KB
    seq = store.append(conv, Message("user", "a question"))
    store.append(conv, Message("assistant", huge), reply_to=seq)
    store.db.execute("INSERT INTO messages (conversation_id, seq, role, content, created) "
                     "VALUES (?, 2, 'user', X'FF00626C6F62', 1.0)", (conv.id,))
    store.close()
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        _, answer, blob = app.query(MessageView)
        assert blob.content == "\ufffd\x00blob" and app.conv.messages[2].content == blob.content
        shown = answer.query_one(Markdown).source
        assert len(shown) == SHOWN_CHARS and huge.startswith(shown)
        more = answer.query_one(ShowAll)
        assert f"{len(huge) - SHOWN_CHARS:,} more characters" in str(more.render())
        more.focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: not answer.query(ShowAll))
        assert answer.query_one(Markdown).source == huge
        assert app.conv.messages[1].content == huge  # the context keeps the whole answer


@pytest.mark.parametrize("damage", ["not a database", "damaged last pages"])
@async_test
async def test_a_database_that_is_not_one_is_moved_aside_with_one_notification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path))
    if damage == "not a database":
        junk = b"my notes, not a database\n" * 100
    else:
        store = Store.open(tmp_path / DB_NAME)
        for i in range(30):
            store.append(Conversation(), Message("user", f"{i} " + "x" * 3000))
        store.close()
        junk = (tmp_path / DB_NAME).read_bytes()
        junk = junk[:-8192] + b"\xa5" * 8192  # a valid header, noise in the last pages
    (tmp_path / DB_NAME).write_bytes(junk)
    app = StrataApp(ChatConfig(EngineOptions(model="tiny"), LoanFlags(), max_new=MAX_NEW))
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        await send(pilot, "hello")
    (moved,) = tmp_path.glob(f"{DB_NAME}.bad-*")
    assert moved.read_bytes() == junk
    said = [n.notification.message for n in notes if isinstance(n, Notify)]
    assert len([m for m in said if "moved to" in m]) == 1
    assert any(str(moved) in m for m in said)
    assert stored(tmp_path)[0][:2] == ("user", "hello")


APP_READ_ONLY = """
    import asyncio, sys
    from pathlib import Path
    from textual.notifications import Notify
    from app.app import StrataApp
    from app.config import ChatConfig
    from app.scenes import wait_ready
    from app.store import Store
    from engine.config import EngineOptions, LoanFlags

    app = StrataApp(ChatConfig(EngineOptions(model="tiny"), LoanFlags(), max_new=8),
                    store=Store.open(Path(sys.argv[1])))
    notes = []

    async def main():
        async with app.run_test(size=(120, 40), message_hook=notes.append) as pilot:
            await wait_ready(pilot)
            print([v.content for v in app.query("MessageView")], flush=True)
        for n in notes:
            if isinstance(n, Notify):
                print(n.notification.title, "|", n.notification.message, flush=True)

    asyncio.run(main())
"""


def test_a_read_only_data_dir_shows_its_history_and_says_so(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB_NAME)
    seq = store.append(Conversation(), Message("user", "kept here"))
    store.append(store.last(), Message("assistant", "its answer"), reply_to=seq)
    store.close()
    proc = run_read_only(tmp_path, APP_READ_ONLY, str(tmp_path / DB_NAME))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "['kept here', 'its answer']",
        (f"Conversations | history is read-only: {tmp_path} is not writable; new messages "
         "are not saved.")]
