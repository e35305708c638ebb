"""Conversations persisted in SQLite, with a versioned schema and forward migrations.

The database lives under the user data dir (`STRATA_DATA_DIR` overrides). Every schema change
is a new entry in MIGRATIONS; `Store.open` applies the missing ones in one transaction each and
records the version in `schema_version`.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_data_dir

from engine.conversation import Conversation, Message

DB_NAME = "conversations.sqlite3"

# version -> statements; append only, never edit a released entry
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL
        )""",
        """CREATE TABLE messages (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            created REAL NOT NULL,
            PRIMARY KEY (conversation_id, seq)
        )""",
    ),
    2: ("CREATE INDEX conversations_by_updated ON conversations(updated DESC)",),
}
SCHEMA_VERSION = max(MIGRATIONS)


def data_dir() -> Path:
    """Where the app keeps its data; STRATA_DATA_DIR overrides the platform default."""
    return Path(os.environ.get("STRATA_DATA_DIR") or user_data_dir("strata-chat"))


@dataclass(frozen=True)
class ConversationInfo:
    """One row of the conversation list."""

    id: str
    title: str
    updated: float
    n_messages: int


class Store:
    """Reads and writes conversations; used from the UI thread only."""

    def __init__(self, db: sqlite3.Connection, path: Path):
        self.db, self.path = db, path

    @classmethod
    def open(cls, path: Path | None = None) -> Store:
        path = path or data_dir() / DB_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path)
        db.execute("PRAGMA foreign_keys = ON")
        store = cls(db, path)
        store.migrate()
        return store

    @property
    def version(self) -> int:
        row = self.db.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def migrate(self) -> None:
        """Bring the schema to SCHEMA_VERSION; refuse a database newer than this code."""
        self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        current = self.version
        if current > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path}: schema version {current} is newer than this app ({SCHEMA_VERSION})"
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            with self.db:
                for statement in MIGRATIONS[version]:
                    self.db.execute(statement)
                self.db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    def save(self, conv: Conversation) -> None:
        """Write the conversation and all its messages (replacing what was stored)."""
        with self.db:
            self.db.execute(
                "INSERT INTO conversations (id, title, created, updated) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET title = excluded.title, updated = excluded.updated",
                (conv.id, conv.title, conv.created, time.time()),
            )
            self.db.execute("DELETE FROM messages WHERE conversation_id = ?", (conv.id,))
            self.db.executemany(
                "INSERT INTO messages (conversation_id, seq, role, content, created) "
                "VALUES (?, ?, ?, ?, ?)",
                [(conv.id, i, m.role, m.content, m.created) for i, m in enumerate(conv.messages)],
            )

    def load(self, conv_id: str) -> Conversation | None:
        row = self.db.execute(
            "SELECT id, title, created FROM conversations WHERE id = ?", (conv_id,)
        ).fetchone()
        if row is None:
            return None
        messages = [
            Message(role, content, created)
            for role, content, created in self.db.execute(
                "SELECT role, content, created FROM messages WHERE conversation_id = ? "
                "ORDER BY seq",
                (conv_id,),
            )
        ]
        return Conversation(id=row[0], messages=messages, title=row[1], created=row[2])

    def last(self) -> Conversation | None:
        """The most recently updated conversation, if any."""
        row = self.db.execute(
            "SELECT id FROM conversations ORDER BY updated DESC LIMIT 1"
        ).fetchone()
        return self.load(row[0]) if row else None

    def list(self) -> list[ConversationInfo]:
        rows = self.db.execute(
            "SELECT c.id, c.title, c.updated, count(m.seq) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id "
            "GROUP BY c.id ORDER BY c.updated DESC"
        )
        return [ConversationInfo(*row) for row in rows]

    def delete(self, conv_id: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))

    def close(self) -> None:
        self.db.close()

    def rename(self, conv_id: str, title: str) -> None:
        """Give a conversation a new title (its messages and times stay as they are)."""
        with self.db:
            self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conv_id))


def export_markdown(conv: Conversation, directory: Path | None = None) -> Path:
    """Write the conversation as Markdown under `directory` (default: data dir/exports)."""
    directory = directory or data_dir() / "exports"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"conversation-{conv.id}.md"
    path.write_text(conv.to_markdown(), encoding="utf-8")
    return path
