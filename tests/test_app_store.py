"""The conversation store: versioned schema, migrations, save/load/list, export."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.store import MIGRATIONS, SCHEMA_VERSION, Store, data_dir, export_markdown
from engine.conversation import Conversation


def conversation(*texts: str) -> Conversation:
    conv = Conversation()
    for i, text in enumerate(texts):
        conv.add("user" if i % 2 == 0 else "assistant", text)
    return conv


def test_a_new_database_gets_every_migration_once(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "db.sqlite3")
    rows = store.db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert [r[0] for r in rows] == sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION + 1))
    store.close()
    again = Store.open(tmp_path / "db.sqlite3")  # reopening applies nothing twice
    assert again.db.execute("SELECT count(*) FROM schema_version").fetchone()[0] == SCHEMA_VERSION


def test_an_old_database_is_migrated_forward_keeping_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in MIGRATIONS[1]:
        db.execute(statement)
    db.execute("INSERT INTO schema_version VALUES (1)")
    db.execute("INSERT INTO conversations VALUES ('abc', 'old one', 1.0, 2.0)")
    db.execute("INSERT INTO messages VALUES ('abc', 0, 'user', 'hi', 1.0)")
    db.commit()
    db.close()
    store = Store.open(path)
    assert store.version == SCHEMA_VERSION
    indexes = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "conversations_by_updated" in indexes
    conv = store.load("abc")
    assert conv is not None and conv.title == "old one"
    assert [(m.role, m.content) for m in conv.messages] == [("user", "hi")]


def test_a_database_from_a_newer_app_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    Store.open(path).close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match="newer than this app"):
        Store.open(path)


def test_save_load_last_list_and_delete(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "db.sqlite3")
    a = conversation("first question", "first answer")
    b = conversation("second question")
    store.save(a)
    store.save(b)
    assert store.last().id == b.id
    b.add("assistant", "second answer")
    store.save(b)  # saving again replaces the messages
    loaded = store.load(b.id)
    assert [m.content for m in loaded.messages] == ["second question", "second answer"]
    assert loaded.title == "second question"
    store.save(a)
    assert [c.id for c in store.list()] == [a.id, b.id]
    assert [c.n_messages for c in store.list()] == [2, 2]
    store.delete(a.id)
    assert [c.id for c in store.list()] == [b.id]
    assert store.load(a.id) is None
    assert (
        store.db.execute(
            "SELECT count(*) FROM messages WHERE conversation_id = ?", (a.id,)
        ).fetchone()[0]
        == 0
    )


def test_data_dir_and_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "data"))
    assert data_dir() == tmp_path / "data"
    conv = conversation("a *question*", "an answer")
    path = export_markdown(conv)
    assert path.parent == tmp_path / "data" / "exports"
    assert path.read_text() == conv.to_markdown()
    assert "## user" in path.read_text() and "an answer" in path.read_text()
