"""The conversation store: versioned schema, migrations, appends from several processes,
durability, unusable files moved aside or refused, export."""

from __future__ import annotations

import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.outbox import Entry, Outbox
from app.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Store,
    StoreError,
    data_dir,
    export_markdown,
)
from engine.request.conversation import Conversation, Message

ROOT = Path(__file__).resolve().parents[1]
DB = "conversations.sqlite3"


def conversation(*texts: str) -> Conversation:
    conv = Conversation()
    for i, text in enumerate(texts):
        conv.add("user" if i % 2 == 0 else "assistant", text)
    return conv


def store_all(store: Store, conv: Conversation) -> None:
    """Append every message of `conv` as the app does: a reply names its prompt."""
    prompt = None
    for m in conv.messages:
        seq = store.append(conv, m, reply_to=prompt if m.role == "assistant" else None)
        prompt = seq if m.role == "user" else None


def rows(path: Path) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return db.execute(
            "SELECT conversation_id, seq, role, content, cancelled, reply_to FROM messages "
            "ORDER BY conversation_id, seq"
        ).fetchall()
    finally:
        db.close()


def python(script: str, *args: str) -> subprocess.Popen[str]:
    """A separate Python process running `script` from the repository root."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


# -- schema --------------------------------------------------------------------------------
def test_a_new_database_gets_every_migration_once(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "db.sqlite3")
    versions = store.db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert [r[0] for r in versions] == sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION + 1))
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()
    again = Store.open(tmp_path / "db.sqlite3")  # reopening applies nothing twice
    assert again.db.execute("SELECT count(*) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    assert again.moved_aside is None


def test_an_old_database_is_migrated_forward_keeping_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in MIGRATIONS[1]:
        db.execute(statement)
    db.execute("INSERT INTO schema_version VALUES (1)")
    db.execute("INSERT INTO conversations VALUES ('abc', 'old one', 1.0, 2.0)")
    db.execute("INSERT INTO messages VALUES ('abc', 0, 'user', 'hi', 1.0)")
    db.execute("INSERT INTO messages VALUES ('abc', 1, 'assistant', 'hello', 1.5)")
    db.commit()
    db.close()
    store = Store.open(path)
    assert store.version == SCHEMA_VERSION
    indexes = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "conversations_by_updated" in indexes
    conv = store.load("abc")
    assert conv is not None and conv.title == "old one"
    assert [(m.role, m.content, m.cancelled) for m in conv.messages] == [
        ("user", "hi", False), ("assistant", "hello", False)]
    assert store.append(conv, Message("user", "again")) == 2  # seqs go on after the old ones


def test_a_database_from_a_newer_app_is_refused_in_one_line_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    store = Store.open(path)
    store_all(store, conversation("keep me"))
    store.db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION + 1,))
    store.close()
    before = rows(path)
    with pytest.raises(StoreError) as exc:
        Store.open(path)
    line = str(exc.value)
    assert "\n" not in line and f"schema version {SCHEMA_VERSION + 1} is newer" in line
    assert "STRATA_DATA_DIR" in line
    assert rows(path) == before  # refused, not moved aside
    assert [p.name for p in tmp_path.iterdir() if ".bad-" in p.name] == []


# -- unusable files ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "damaged"])
def test_a_file_that_is_not_a_database_is_moved_aside_and_a_new_one_started(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / DB
    junk = b"these are notes, not a database\n" * 200
    if kind == "damaged":  # an SQLite header, then garbage
        junk = b"SQLite format 3\x00" + junk
    path.write_bytes(junk)
    if kind == "text":
        (tmp_path / f"{DB}-wal").write_bytes(b"stale")
    store = Store.open(path)
    moved = store.moved_aside
    assert moved is not None and moved.name.startswith(f"{DB}.bad-")
    assert moved.read_bytes() == junk  # kept, byte for byte
    if kind == "text":
        assert Path(f"{moved}-wal").read_bytes() == b"stale"  # its companion went with it
    assert store.version == SCHEMA_VERSION and store.list() == []
    store_all(store, conversation("a fresh start"))
    assert [m.content for m in store.last().messages] == ["a fresh start"]


def test_a_database_of_something_else_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (text TEXT)")
    db.execute("INSERT INTO notes VALUES ('mine')")
    db.commit()
    db.close()
    before = path.read_bytes()
    store = Store.open(path)
    assert store.moved_aside is not None
    assert store.moved_aside.read_bytes() == before  # moved as it was, not even set to WAL
    kept = sqlite3.connect(store.moved_aside)
    assert kept.execute("SELECT text FROM notes").fetchall() == [("mine",)]
    kept.close()
    assert store.version == SCHEMA_VERSION


@pytest.mark.parametrize("where", ["dir", "parent"])
def test_a_data_directory_that_is_a_file_is_refused_in_one_line(
    tmp_path: Path, where: str
) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("not a directory")
    path = blocker / DB if where == "dir" else blocker / "sub" / DB
    with pytest.raises(StoreError) as exc:
        Store.open(path)
    line = str(exc.value)
    assert "\n" not in line and "is a file" in line and "STRATA_DATA_DIR" in line
    assert blocker.read_text() == "not a directory"


# -- appends -------------------------------------------------------------------------------
def test_messages_are_appended_with_the_next_seq_and_the_first_title_kept(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / DB)
    conv = Conversation()
    assert store.append(conv, Message("user", "first question\nsecond line")) == 0
    assert store.append(conv, Message("assistant", "an answer"), reply_to=0) == 1
    assert store.append(conv, Message("user", "another question")) == 2
    assert store.append(conv, Message("assistant", "cut sh", cancelled=True), reply_to=2) == 3
    loaded = store.load(conv.id)
    assert loaded.title == "first question"
    assert [(m.role, m.content, m.cancelled) for m in loaded.messages] == [
        ("user", "first question\nsecond line", False),
        ("assistant", "an answer", False),
        ("user", "another question", False),
        ("assistant", "cut sh", True),
    ]
    assert store.list()[0].n_messages == 4


def test_two_connections_never_drop_each_others_rows(tmp_path: Path) -> None:
    # both instances reopen the last conversation and talk in it at the same time
    first = Store.open(tmp_path / DB)
    store_all(first, conversation("shared start", "shared answer"))
    second = Store.open(tmp_path / DB)
    a, b = first.last(), second.last()
    assert a.id == b.id
    pa = first.append(a, Message("user", "from a"))
    pb = second.append(b, Message("user", "from b"))
    second.append(b, Message("assistant", "answer b"), reply_to=pb)
    first.append(a, Message("assistant", "answer a"), reply_to=pa)
    assert (pa, pb) == (2, 3)
    for store in (first, second):  # whoever reads sees every row, each reply after its prompt
        assert [m.content for m in store.load(a.id).messages] == [
            "shared start", "shared answer", "from a", "answer a", "from b", "answer b"]


def test_a_withdrawn_prompt_takes_its_title_with_it(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    conv = Conversation()
    seq = store.append(conv, Message("user", "cancelled at once"))
    store.withdraw(conv.id, seq)
    assert store.list() == []  # nothing left: no empty conversation in the list
    first = store.append(conv, Message("user", "kept prompt"))
    store.append(conv, Message("assistant", "answer"), reply_to=first)
    seq = store.append(conv, Message("user", "withdrawn later"))
    store.withdraw(conv.id, seq)
    (info,) = store.list()
    assert (info.title, info.n_messages) == ("kept prompt", 2)


def test_a_failed_write_is_a_store_error_not_a_traceback(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    holder = sqlite3.connect(tmp_path / DB, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")  # another writer that never lets go
    store.db.execute("PRAGMA busy_timeout = 50")
    with pytest.raises(StoreError, match="database is locked"):
        store.append(Conversation(), Message("user", "hello"))
    holder.rollback()
    holder.close()
    assert store.append(Conversation(), Message("user", "hello")) == 0  # and it recovers


WRITER = """
    import sys, time
    from pathlib import Path
    from app.store import Store
    from engine.request.conversation import Message

    path, name, n, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    store = Store.open(path)
    conv = store.last()  # both reopen the last conversation
    while not go.exists():
        time.sleep(0.001)
    for i in range(n):
        seq = store.append(conv, Message("user", f"{name} prompt {i}"))
        store.append(conv, Message("assistant", f"{name} answer {i}"), reply_to=seq)
    print("done", flush=True)
"""


def test_two_processes_appending_to_one_conversation_keep_every_row(tmp_path: Path) -> None:
    path, go, n = tmp_path / DB, tmp_path / "go", 60
    store = Store.open(path)
    shared = conversation("shared start", "shared answer")
    store_all(store, shared)
    writers = [python(WRITER, str(path), name, str(n), str(go)) for name in ("a", "b")]
    time.sleep(0.5)  # both have opened the database and wait
    go.touch()
    for w in writers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0 and out == "done\n", err
    stored = rows(path)
    assert [r[1] for r in stored] == list(range(2 + 4 * n))  # every seq once, none lost
    messages = [m.content for m in store.load(shared.id).messages]
    assert messages[:2] == ["shared start", "shared answer"]
    for name in ("a", "b"):
        mine = [m for m in messages if m.startswith(name)]
        assert mine == [f"{name} {kind} {i}" for i in range(n) for kind in ("prompt", "answer")]
    for prompt, answer in zip(messages[2::2], messages[3::2]):  # each reply after its prompt
        assert answer == prompt.replace("prompt", "answer")


def test_a_prompt_is_on_disk_as_soon_as_append_returns(tmp_path: Path) -> None:
    script = """
        import sys, time
        from pathlib import Path
        from app.store import Store
        from engine.request.conversation import Conversation, Message

        store = Store.open(Path(sys.argv[1]))
        store.append(Conversation(), Message("user", "written before the crash"))
        print("sent", flush=True)
        time.sleep(60)
    """
    proc = python(script, str(tmp_path / DB))
    assert proc.stdout.readline() == "sent\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert Store.open(tmp_path / DB).last().messages[0].content == "written before the crash"


# -- damaged databases ---------------------------------------------------------------------
def filled(path: Path, n: int = 40) -> Conversation:
    """A closed database of ours with `n` messages of ~2 KB (dozens of pages, WAL merged)."""
    store = Store.open(path)
    conv = conversation(*[f"message {i} " + "x" * 2000 for i in range(n)])
    store_all(store, conv)
    store.close()
    assert not Path(f"{path}-wal").exists()
    return conv


@pytest.mark.parametrize("damage", ["overwritten", "truncated"])
def test_a_database_with_damaged_last_pages_is_moved_aside(tmp_path: Path, damage: str) -> None:
    path = tmp_path / DB
    filled(path)
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    assert data.startswith(b"SQLite format 3\x00") and len(data) > 20 * page
    if damage == "overwritten":  # the header stays valid; the last three pages are noise
        data[-3 * page :] = bytes((i * 151 + 7) % 256 for i in range(3 * page))
    else:
        del data[-3 * page :]
    path.write_bytes(bytes(data))
    store = Store.open(path)
    assert store.moved_aside is not None and store.moved_aside.read_bytes() == bytes(data)
    assert store.list() == [] and store.version == SCHEMA_VERSION
    store_all(store, conversation("after the damage"))
    store.close()
    again = Store.open(path)  # the next start opens the new one as it is
    assert again.moved_aside is None
    assert [m.content for m in again.last().messages] == ["after the damage"]


@pytest.mark.parametrize("damage", ["messages dropped", "conversations dropped",
                                    "column dropped", "schema_version abc", "schema_version 1.5"])
def test_a_database_missing_a_table_or_with_a_bad_version_is_moved_aside(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / DB
    filled(path, 3)
    db = sqlite3.connect(path)
    if damage.endswith("dropped"):
        what = damage.split()[0]
        statement = (f"DROP TABLE {what}" if what != "column"
                     else "ALTER TABLE messages DROP COLUMN partial")
        db.execute(statement)
    else:
        db.execute("UPDATE schema_version SET version = ? WHERE version = 1",
                   (damage.split()[1],))
    db.commit()
    db.close()
    store = Store.open(path)
    assert store.moved_aside is not None and store.version == SCHEMA_VERSION
    assert store.list() == []


def test_rows_of_the_wrong_type_read_as_text(tmp_path: Path) -> None:
    path = tmp_path / DB
    store = Store.open(path)
    conv = conversation("a real prompt")
    store_all(store, conv)
    db = sqlite3.connect(path)  # rows another program wrote: SQLite keeps any type in a column
    rows_in = [(1, "assistant", b"caf\xc3\xa9 \xff bytes"), (2, "user", 42), (3, "user", 1.5),
               (4, b"\x00role", "an unknown role"), (5, "assistant", "x")]
    for seq, role, content in rows_in:
        db.execute("INSERT INTO messages (conversation_id, seq, role, content, created) "
                   "VALUES (?, ?, ?, ?, ?)", (conv.id, seq, role, content, "yesterday"))
    # not-UTF-8 bytes stored as TEXT, a NULL and a BLOB where NOT NULL would refuse them
    db.execute("UPDATE messages SET content = CAST(X'6F6BFE' AS TEXT) WHERE seq = 5")
    db.execute("PRAGMA ignore_check_constraints = ON")
    db.execute("UPDATE conversations SET title = X'C3A9FF'")
    db.commit()
    db.close()
    loaded = store.load(conv.id)
    assert [(m.role, m.content) for m in loaded.messages] == [
        ("user", "a real prompt"), ("assistant", "café \ufffd bytes"), ("user", "42"),
        ("user", "1.5"), ("assistant", "an unknown role"), ("assistant", "ok\ufffd")]
    assert loaded.title == "é\ufffd" and all(m.created == 0.0 for m in loaded.messages[1:])
    (info,) = store.list()
    assert info.title == "é\ufffd" and info.n_messages == 6
    assert store.last().id == conv.id


def test_a_lone_surrogate_is_stored_as_a_replacement_not_a_traceback(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    conv = Conversation()
    store.append(conv, Message("user", "half a pair: \ud800"))
    assert store.load(conv.id).messages[0].content == "half a pair: ?"


# -- answers kept as they stream -----------------------------------------------------------
def test_a_partial_answer_is_rewritten_then_completed(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    conv = Conversation()
    prompt = store.append(conv, Message("user", "tell me"))
    other = store.append(conv, Message("user", "from another window"))  # between the two
    seq = store.append(conv, Message("assistant", "Once"), prompt, partial=True)
    store.update(conv.id, seq, Message("assistant", "Once upon"), partial=True)
    (_, answer, _) = store.load(conv.id).messages
    assert (answer.content, answer.interrupted, answer.cancelled) == ("Once upon", True, False)
    store.update(conv.id, seq, Message("assistant", "Once upon a time"))
    assert [(m.content, m.interrupted) for m in store.load(conv.id).messages] == [
        ("tell me", False), ("Once upon a time", False), ("from another window", False)]
    assert other == 1 and store.list()[0].n_messages == 3


def test_kill_9_while_an_answer_streams_keeps_it_marked_interrupted(tmp_path: Path) -> None:
    script = """
        import sys, time
        from pathlib import Path
        from app.store import Store
        from engine.request.conversation import Conversation, Message

        store = Store.open(Path(sys.argv[1]))
        conv = Conversation()
        prompt = store.append(conv, Message("user", "a long question"))
        text = "the answer so far"
        seq = store.append(conv, Message("assistant", text), prompt, partial=True)
        for word in (" grows", " word", " by word"):
            text += word
            store.update(conv.id, seq, Message("assistant", text), partial=True)
        print("streaming", flush=True)
        time.sleep(60)
    """
    proc = python(script, str(tmp_path / DB))
    assert proc.stdout.readline() == "streaming\n", proc.stderr.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    store = Store.open(tmp_path / DB)
    assert store.moved_aside is None
    prompt, answer = store.last().messages
    assert prompt.content == "a long question" and not prompt.interrupted
    assert answer.content == "the answer so far grows word by word"
    assert answer.interrupted and not answer.cancelled
    assert "## assistant (interrupted)" in store.last().to_markdown()


# -- a full disk -----------------------------------------------------------------------------
def fill_disk(store: Store) -> None:
    """SQLite's own disk-full path: the database may not grow by one page (SQLITE_FULL)."""
    (pages,) = store.db.execute("PRAGMA page_count").fetchone()
    store.db.execute(f"PRAGMA max_page_count = {pages}")


def free_disk(store: Store) -> None:
    store.db.execute("PRAGMA max_page_count = 1073741823")


def test_messages_refused_by_a_full_disk_wait_in_order_and_are_written_later(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / DB)
    outbox = Outbox(store)
    conv = Conversation()
    first = Entry(conv, Message("user", "before the disk filled"))
    assert outbox.put(first) and first.seq == 0
    fill_disk(store)
    prompt = Entry(conv, Message("user", "a long prompt " * 1000))  # needs new pages
    answer = Entry(conv, Message("assistant", "partial"), reply_to=prompt, partial=True)
    assert not outbox.put(prompt)
    assert "database or disk is full" in outbox.error and "\n" not in outbox.error
    assert not outbox.put(answer)
    answer.message = Message("assistant", "the whole answer")  # it grew while it waited
    answer.partial = False
    assert not outbox.put(answer) and outbox.n_waiting == 2
    assert not outbox.flush() and len(store.load(conv.id).messages) == 1
    free_disk(store)
    assert outbox.flush() and outbox.n_waiting == 0 and outbox.error == ""
    assert (prompt.seq, answer.seq) == (1, 2)
    assert [r[1:] for r in rows(tmp_path / DB)] == [
        (0, "user", "before the disk filled", 0, None),
        (1, "user", "a long prompt " * 1000, 0, None),
        (2, "assistant", "the whole answer", 0, 1)]
    assert [m.interrupted for m in store.load(conv.id).messages] == [False] * 3


def test_a_withdrawn_exchange_that_waited_is_never_written(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    outbox = Outbox(store)
    conv = Conversation()
    fill_disk(store)
    prompt = Entry(conv, Message("user", "failed request " * 1000))
    assert not outbox.put(prompt)
    assert outbox.withdraw(prompt) and outbox.n_waiting == 0  # nothing left to write
    free_disk(store)
    kept = Entry(conv, Message("user", "kept"))
    answer = Entry(conv, Message("assistant", "so far"), reply_to=kept, partial=True)
    assert outbox.put(kept) and outbox.put(answer) and answer.seq == 1
    assert outbox.withdraw(answer) and outbox.withdraw(kept)  # written rows are removed
    assert rows(tmp_path / DB) == [] and store.list() == []


# -- read-only -------------------------------------------------------------------------------
READ_ONLY = """
    import sys
    from pathlib import Path
    from app.store import Store, StoreError
    from engine.request.conversation import Message

    store = Store.open(Path(sys.argv[1]))
    print(store.read_only)
    conv = store.last()
    print([(m.content, m.cancelled) for m in conv.messages])
    try:
        store.append(conv, Message("user", "more"))
    except StoreError as exc:
        print(exc)
"""


def run_read_only(directory: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `script` with `directory` read-only: root writes anywhere, so for root it is a
    read-only bind mount in a mount namespace of the child's own; for others, mode 555."""
    argv = [sys.executable, "-c", textwrap.dedent(script), *args]
    if os.geteuid() == 0:
        d = shlex.quote(str(directory))
        mount = f'mount --bind {d} {d} && mount -o remount,bind,ro {d} && exec "$0" "$@"'
        argv = ["unshare", "-m", "sh", "-c", mount, *argv]
    directory.chmod(0o555)
    try:
        return subprocess.run(argv, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        directory.chmod(0o755)


@pytest.mark.parametrize("old", [False, True])
def test_a_read_only_data_dir_opens_its_database_read_only(tmp_path: Path, old: bool) -> None:
    path = tmp_path / DB
    store = Store.open(path)
    store_all(store, conversation("kept here", "its answer"))
    if old:  # a database from before the `partial` column: read all the same
        store.db.execute("ALTER TABLE messages DROP COLUMN partial")
        store.db.execute("DELETE FROM schema_version WHERE version = 4")
    store.close()
    proc = run_read_only(tmp_path, READ_ONLY, str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{tmp_path} is not writable",
        "[('kept here', False), ('its answer', False)]",
        f"history is read-only: {tmp_path} is not writable"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB]


def test_a_read_only_data_dir_without_a_database_is_one_line(tmp_path: Path) -> None:
    proc = run_read_only(tmp_path, """
        import sys
        from pathlib import Path
        from app.store import Store, StoreError
        try:
            Store.open(Path(sys.argv[1]))
        except StoreError as exc:
            print(exc)
    """, str(tmp_path / DB))
    assert proc.stdout == (f"no history can be kept: {tmp_path} is not writable; make it "
                           "writable, or set STRATA_DATA_DIR to use another directory\n")


# -- export --------------------------------------------------------------------------------
def test_data_dir_and_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "data"))
    assert data_dir() == tmp_path / "data"
    conv = conversation("a *question*", "an answer")
    conv.add("user", "more")
    conv.add("assistant", "cut", cancelled=True)
    path = export_markdown(conv)
    assert path.parent == tmp_path / "data" / "exports"
    assert path.read_text() == conv.to_markdown()
    assert "## user" in path.read_text() and "an answer" in path.read_text()
    assert "## assistant (cancelled)" in path.read_text()


def test_an_export_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "exports").write_text("a file")
    with pytest.raises(StoreError, match="cannot export"):
        export_markdown(conversation("q"), tmp_path / "exports")
