"""Conversations persisted in SQLite, with a versioned schema and forward migrations.

The database lives under the user data dir (`STRATA_DATA_DIR` overrides). Every schema change
is a new entry in MIGRATIONS; `Store.open` applies the missing ones in one transaction each and
records the version in `schema_version`.

Messages are appended as they happen: several app instances may write to one database (WAL, a
busy timeout), and each new message takes the next `seq` of its conversation inside a write
transaction, so two writers never clash and no row is ever dropped. A reply records the `seq` of
the prompt it answers, so exchanges read in order even when two instances talked in one
conversation at the same time. The one row ever rewritten is an answer still being generated:
it is appended `partial` with its first text and its writer rewrites it as the text grows, so a
kill keeps what was shown; a row left partial (its writer died) reads as `interrupted`.

Whatever the damage, a file that is not a healthy database of ours (not SQLite, a failed
`PRAGMA quick_check`, a table or column missing, a schema version that is not an integer) is
moved aside (never deleted) and a new one started. Rows of the wrong type read as text (bytes
decoded with replacement characters). A database from a newer app, or a data directory that
cannot be used, is refused with one line; a database that cannot be written (a read-only file
or directory) opens read-only and says why in `read_only`.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platformdirs import user_data_dir

from app.search import (
    HIT_END,
    HIT_START,
    SEARCH_LIMIT,
    SEARCH_SCAN,
    SNIPPET_TOKENS,
    Found,
    SearchHit,
    fts_query,
    like_pattern,
    parse_snippet,
    search_terms,
    substring_snippet,
)
from engine.atomic_file import aside_path
from engine.errors import FlagError, StrataError
from engine.request.conversation import ROLES, Conversation, Message, Sampling, title_of
from engine.request.sampler import SamplingParams

DB_NAME = "conversations.sqlite3"
# the input's Up/Down history: the newest prompts, and the characters of them kept in memory
HISTORY_PROMPTS = 1000
HISTORY_CHARS = 16 * 1024 * 1024
BUSY_TIMEOUT_S = 10.0  # another instance's write transaction is short; wait for it
# a database's companion files, moved aside with it
_COMPANIONS = ("-wal", "-shm", "-journal")
# SQLite's answers for a file that is not a (healthy) database: moved aside, never deleted
_NOT_A_DATABASE = frozenset({"SQLITE_NOTADB", "SQLITE_CORRUPT"})
_SQLITE_MAGIC = b"SQLite format 3\x00"

# The full-text index of message contents: FTS5 over `messages` (external content: the text is
# kept once), kept in step by triggers. Every statement may run again: `Store.open` re-runs them
# (and rebuilds the index) when a database lacks any, e.g. one last written where SQLite had no
# FTS5. unicode61 folds case and (2) diacritics: "cafe" finds "café".
_FTS = "messages_fts"
_FTS_TRIGGERS = ("messages_fts_insert", "messages_fts_delete", "messages_fts_update")
_FTS_STATEMENTS = (
    f"""CREATE VIRTUAL TABLE IF NOT EXISTS {_FTS} USING fts5(content, content='messages',
        content_rowid='rowid', tokenize='unicode61 remove_diacritics 2')""",
    f"""CREATE TRIGGER IF NOT EXISTS {_FTS_TRIGGERS[0]} AFTER INSERT ON messages BEGIN
        INSERT INTO {_FTS} (rowid, content) VALUES (new.rowid, new.content);
    END""",
    # the index forgets a row by its old text: exactly what was indexed, or it is damaged
    f"""CREATE TRIGGER IF NOT EXISTS {_FTS_TRIGGERS[1]} AFTER DELETE ON messages BEGIN
        INSERT INTO {_FTS} ({_FTS}, rowid, content) VALUES ('delete', old.rowid, old.content);
    END""",
    # an answer rewritten as it streams is indexed anew each time
    f"""CREATE TRIGGER IF NOT EXISTS {_FTS_TRIGGERS[2]} AFTER UPDATE OF content ON messages
        WHEN old.content IS NOT new.content BEGIN
        INSERT INTO {_FTS} ({_FTS}, rowid, content) VALUES ('delete', old.rowid, old.content);
        INSERT INTO {_FTS} (rowid, content) VALUES (new.rowid, new.content);
    END""",
    f"INSERT INTO {_FTS} ({_FTS}) VALUES ('rebuild')",  # the rows already there
)


def _fts5_available() -> bool:
    """Whether this SQLite has FTS5 with the tokenizer the index uses (most builds do)."""
    db = sqlite3.connect(":memory:")
    try:
        db.execute("CREATE TABLE messages (content TEXT)")
        db.execute(_FTS_STATEMENTS[0])
        return True
    except sqlite3.Error:
        return False
    finally:
        db.close()


FTS5 = _fts5_available()

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
    3: (
        "ALTER TABLE messages ADD COLUMN cancelled INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE messages ADD COLUMN reply_to INTEGER",  # the seq of the prompt answered
    ),
    # an answer written as it streams: 1 until its writer stores the final text
    4: ("ALTER TABLE messages ADD COLUMN partial INTEGER NOT NULL DEFAULT 0",),
    # a conversation's system prompt and sampling; NULL sampling: the app's defaults (a
    # conversation from before this version)
    5: (
        "ALTER TABLE conversations ADD COLUMN system_prompt TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE conversations ADD COLUMN temperature REAL",
        "ALTER TABLE conversations ADD COLUMN top_p REAL",
        "ALTER TABLE conversations ADD COLUMN top_k INTEGER",
        "ALTER TABLE conversations ADD COLUMN seed INTEGER",  # two's complement: see _seed_in
        "ALTER TABLE conversations ADD COLUMN max_tokens INTEGER",
    ),
    6: _FTS_STATEMENTS,  # where this SQLite has no FTS5, recorded without them
}
SCHEMA_VERSION = max(MIGRATIONS)
_FTS_VERSION = 6
assert MIGRATIONS[_FTS_VERSION] is _FTS_STATEMENTS
# what an older database read-only lacks reads as these (its rows predate the columns)
_COLUMN_DEFAULTS = {"cancelled": "0", "reply_to": "NULL", "partial": "0"}
# a conversation's own settings, written with each of its messages and by `configure`
_SETTINGS_COLUMNS = ("system_prompt", "temperature", "top_p", "top_k", "seed", "max_tokens")
_CONVERSATION_DEFAULTS = {"system_prompt": "''", **dict.fromkeys(_SETTINGS_COLUMNS[1:], "NULL")}
# a reply reads right after its prompt, whatever another instance appended in between
_IN_ORDER = "ORDER BY coalesce(reply_to, seq), seq"
# message m's position in its conversation as `load` reads it (_IN_ORDER)
_POSITION = ("(SELECT count(*) FROM messages p WHERE p.conversation_id = m.conversation_id "
             "AND (coalesce(p.reply_to, p.seq), p.seq) < (coalesce(m.reply_to, m.seq), m.seq))")
_SNIPPET_READ_CHARS = 1 << 20  # a substring search draws a match past this from the start


class StoreError(StrataError):
    """The conversation database cannot be used, or a read or write failed (one line)."""


class _Unreadable(StoreError):
    """The file is not a healthy database of ours: `Store.open` moves it aside."""


def _expected_tables() -> dict[str, set[str]]:
    """Every table and its columns after all migrations (run once on an in-memory database:
    the migrations are the one description of the schema).

    The full-text index is not among them: a database without it (read-only and older, or
    written where SQLite has no FTS5) is healthy, and searched without it."""
    db = sqlite3.connect(":memory:")
    try:
        for version in sorted(MIGRATIONS):
            for statement in _statements(version):
                db.execute(statement)
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
                  if not _is_index_table(r[0])]
        return {t: {r[1] for r in db.execute(f"PRAGMA table_info({t})")} for t in tables}
    finally:
        db.close()


def _statements(version: int) -> tuple[str, ...]:
    """Migration `version`'s statements as this SQLite can run them."""
    return () if version == _FTS_VERSION and not FTS5 else MIGRATIONS[version]


def _is_index_table(name: str) -> bool:
    """The FTS5 table or one of its shadow tables (messages_fts_data, _idx, ...)."""
    return name == _FTS or name.startswith(f"{_FTS}_")


_TABLES = _expected_tables()


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
    """Reads and writes conversations; used from the UI thread only.

    `moved_aside` is where `open` put a file it could not use before starting clean (None
    when the database opened as it was); `read_only` says why nothing can be written ("" when
    it can). The app says each once.
    """

    def __init__(self, db: sqlite3.Connection, path: Path, moved_aside: Path | None = None,
                 read_only: str = ""):
        self.db, self.path, self.moved_aside, self.read_only = db, path, moved_aside, read_only

    @classmethod
    def open(cls, path: Path | None = None) -> Store:
        """Open (or create) the database at `path` (default: data dir) and migrate it.

        Raises StoreError when the directory cannot hold it or its schema is newer than this
        app; a file that is not a database of ours is moved aside and a new one created.
        """
        path = path or data_dir() / DB_NAME
        _make_dir(path.parent)
        read_only = _not_writable(path)
        if read_only and not path.exists():
            raise StoreError(f"no history can be kept: {read_only}; make it writable, or set "
                             "STRATA_DATA_DIR to use another directory")
        try:
            if not _sqlite_header(path):  # moved before SQLite opens it (or its -wal)
                raise _Unreadable(f"{path}: not an SQLite database")
            return cls._connect(path, read_only)
        except _Unreadable:
            if read_only:
                raise StoreError(
                    f"{path} cannot be read as a conversation database and cannot be moved "
                    f"aside ({read_only}); move it, or "
                    "set STRATA_DATA_DIR to use another directory") from None
            moved = _move_aside(path)
        store = cls._connect(path)
        store.moved_aside = moved
        return store

    @classmethod
    def _connect(cls, path: Path, read_only: str = "") -> Store:
        try:
            if read_only:
                db = _connect_read_only(path)
            else:
                db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"{path}: {exc}") from None
        db.text_factory = _decode  # text that is not UTF-8 reads with replacement characters
        store = cls(db, path, read_only=read_only)
        try:
            with store._errors():
                db.execute("PRAGMA foreign_keys = ON")
                store._check()  # a damaged file is moved aside before anything is written
                if read_only:
                    store._read_older_schema()
                else:
                    store.migrate()  # first, so a database of something else is left as it was
                    db.execute("PRAGMA journal_mode = WAL")  # readers never wait for a writer
                store._check_tables()
        except BaseException:
            db.close()
            raise
        return store

    def _check(self) -> None:
        """Refuse (to move aside) a file SQLite finds damaged or whose schema_version is not
        integers; a newer app's database is left to `migrate` to refuse."""
        problems = [r[0] for r in self.db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise _Unreadable(f"{self.path}: damaged ({'; '.join(map(str, problems))})")
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master")}
        if "schema_version" in tables:
            (bad,) = self.db.execute(
                "SELECT count(*) FROM schema_version WHERE typeof(version) != 'integer'"
            ).fetchone()
            if bad:
                raise _Unreadable(f"{self.path}: a schema version that is not an integer")

    def _check_tables(self) -> None:
        """Every table this version writes is there with its columns (else moved aside)."""
        if self.version > SCHEMA_VERSION:
            return  # refused by `migrate`; read-only, read with what is there
        for table, columns in _TABLES.items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            missing = columns - have
            if missing:
                what = f"table {table}" if not have else f"{table}.{min(missing)}"
                raise _Unreadable(f"{self.path}: not a strata conversation database ({what} "
                                  "is missing)")

    def _read_older_schema(self) -> None:
        """Read-only, an older schema cannot be migrated: a temporary view stands in for its
        messages, with the newer columns at their defaults (temp names come first)."""
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master")}
        if "schema_version" not in tables:
            raise _Unreadable(f"{self.path}: not a strata conversation database")
        if self.version > SCHEMA_VERSION or "messages" not in tables:
            return
        # by the columns, not the version: a gap in the versions may be filled later
        for table, defaults in (("messages", _COLUMN_DEFAULTS),
                                ("conversations", _CONVERSATION_DEFAULTS)):
            have = {r[1] for r in self.db.execute(f"PRAGMA main.table_info({table})")}
            extra = [f"{v} AS {k}" for k, v in defaults.items() if k not in have]
            if extra:
                self.db.execute(
                    f"CREATE TEMP VIEW {table} AS SELECT *, {', '.join(extra)} FROM main.{table}"
                )

    @property
    def version(self) -> int:
        """The schema version recorded in the database (0 before the first migration)."""
        row = self.db.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def migrate(self) -> None:
        """Bring the schema to SCHEMA_VERSION; refuse a database newer than this code.

        Each migration runs in its own write transaction and re-reads the versions inside it,
        so two instances starting on one new database apply every migration once. A version
        not recorded is applied even after a later one (a gap in the numbers, filled later).
        """
        with self._write():
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master")}
            if tables and "schema_version" not in tables:
                raise _Unreadable(f"{self.path}: not a strata conversation database")
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        for version in sorted(MIGRATIONS):
            with self._write():
                current = self.version
                if current > SCHEMA_VERSION:
                    raise StoreError(
                        f"{self.path}: schema version {current} is newer than this app "
                        f"({SCHEMA_VERSION}); run a newer strata, or set STRATA_DATA_DIR to "
                        "use another directory"
                    )
                if self.db.execute("SELECT 1 FROM schema_version WHERE version = ?",
                                   (version,)).fetchone():
                    continue
                for statement in _statements(version):
                    self.db.execute(statement)
                self.db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        self._sync_index()

    def _sync_index(self) -> None:
        """Make the full-text index what this SQLite can keep: where FTS5 is, the index and
        its triggers, rebuilt when any was missing; where it is not, no triggers (they would
        refuse every write), so the next open with FTS5 rebuilds the index."""
        with self._write():
            names = {r[0] for r in self.db.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table', 'trigger')")}
            if "messages" not in names:
                return  # not a database of ours: `_check_tables` moves it aside
            if not FTS5:
                for trigger in _FTS_TRIGGERS:
                    self.db.execute(f"DROP TRIGGER IF EXISTS {trigger}")
            elif not {_FTS, *_FTS_TRIGGERS} <= names:
                for statement in _FTS_STATEMENTS:
                    self.db.execute(statement)

    def append(self, conv: Conversation, message: Message, reply_to: int | None = None,
               partial: bool = False) -> int:
        """Append `message` to `conv` in the database; returns the message's `seq`.

        The conversation row is created if missing (its title, once set, is kept); the seq is
        the next free one of the conversation, taken inside the write transaction. `reply_to`
        is the seq of the prompt an answer belongs to; `partial`: an answer still being
        generated, which `update` rewrites until it is complete. The conversation's system
        prompt and sampling are written with it (a `configure` the store refused is kept).
        """
        title = _storable(conv.title or (title_of(message.content) if message.role == "user"
                                         else ""))
        content = _storable(message.content)
        with self._write():
            self.db.execute(
                "INSERT INTO conversations (id, title, created, updated, "
                f"{', '.join(_SETTINGS_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET updated = excluded.updated, "
                "title = CASE WHEN title = '' THEN excluded.title ELSE title END, "
                + ", ".join(f"{c} = excluded.{c}" for c in _SETTINGS_COLUMNS),
                (conv.id, title, conv.created, time.time(), *_settings_row(conv)),
            )
            (seq,) = self.db.execute(
                "INSERT INTO messages "
                "(conversation_id, seq, role, content, created, cancelled, reply_to, partial) "
                "SELECT ?1, coalesce(max(seq) + 1, 0), ?2, ?3, ?4, ?5, ?6, ?7 FROM messages "
                "WHERE conversation_id = ?1 RETURNING seq",
                (conv.id, message.role, content, message.created,
                 int(message.cancelled), reply_to, int(partial)),
            ).fetchone()
        return int(seq)

    def update(self, conv_id: str, seq: int, message: Message, partial: bool = False) -> None:
        """Rewrite the text of a partial answer this instance appended (its final text when
        `partial` is False); one short transaction, whatever the text's length."""
        content = _storable(message.content)
        with self._write():
            self.db.execute(
                "UPDATE messages SET content = ?, cancelled = ?, partial = ? "
                "WHERE conversation_id = ? AND seq = ?",
                (content, int(message.cancelled), int(partial), conv_id, seq),
            )
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?",
                            (time.time(), conv_id))

    def withdraw(self, conv_id: str, seq: int) -> None:
        """Remove one message: a prompt that got no answer and went back to the input.

        The title follows the first prompt left; a conversation left empty is removed.
        """
        with self._write():
            self.db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND seq = ?", (conv_id, seq)
            )
            self._after_removal(conv_id)

    def truncate(self, conv_id: str, n_keep: int) -> None:
        """Remove every message after the first `n_keep` in reading order (an edited message
        sent again, or an answer regenerated: it and everything after it go). The title
        follows the first prompt left; a conversation left empty is removed."""
        assert n_keep >= 0, f"n_keep {n_keep} < 0"
        with self._write():
            self.db.execute(
                "DELETE FROM messages WHERE conversation_id = ?1 AND seq IN ("
                f"SELECT seq FROM messages WHERE conversation_id = ?1 {_IN_ORDER} "
                "LIMIT -1 OFFSET ?2)",
                (conv_id, n_keep),
            )
            self._after_removal(conv_id)

    def _after_removal(self, conv_id: str) -> None:
        """Inside a write: the title follows the first prompt left; no message, no row."""
        first = self.db.execute(
            f"SELECT content FROM messages WHERE conversation_id = ? AND role = 'user' "
            f"{_IN_ORDER} LIMIT 1",
            (conv_id,),
        ).fetchone()
        first = (_text(first[0]),) if first else None
        left = self.db.execute(
            "SELECT count(*) FROM messages WHERE conversation_id = ?", (conv_id,)
        ).fetchone()[0]
        if not left:
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
        else:
            self.db.execute(
                "UPDATE conversations SET title = ? WHERE id = ?",
                (title_of(first[0]) if first else "", conv_id),
            )

    def configure(self, conv: Conversation) -> None:
        """Store the conversation's system prompt and sampling. A conversation not stored yet
        (no message) is left alone: its first message writes them."""
        with self._write():
            self.db.execute(
                "UPDATE conversations SET "
                + ", ".join(f"{c} = ?" for c in _SETTINGS_COLUMNS) + " WHERE id = ?",
                (*_settings_row(conv), conv.id),
            )

    def load(self, conv_id: str) -> Conversation | None:
        """The conversation with every stored message, exchanges in order; None if absent.
        Stored sampling that is not valid reads as None (the app's defaults)."""
        with self._errors():
            row = self.db.execute(
                f"SELECT id, title, created, {', '.join(_SETTINGS_COLUMNS)} FROM conversations "
                "WHERE id = ?", (conv_id,)
            ).fetchone()
            if row is None:
                return None
            messages = [
                Message(_role(role), _text(content), _number(created), cancelled == 1,
                        interrupted=partial == 1)
                for role, content, created, cancelled, partial in self.db.execute(
                    "SELECT role, content, created, cancelled, partial FROM messages "
                    f"WHERE conversation_id = ? {_IN_ORDER}",
                    (conv_id,),
                )
            ]
        return Conversation(id=row[0], messages=messages, title=_text(row[1]),
                            created=_number(row[2]), system=_text(row[3]),
                            sampling=_sampling(row[4:]))

    def last(self) -> Conversation | None:
        """The most recently updated conversation, if any."""
        with self._errors():
            row = self.db.execute(
                "SELECT id FROM conversations ORDER BY updated DESC LIMIT 1"
            ).fetchone()
        return self.load(row[0]) if row else None

    def list(self) -> list[ConversationInfo]:
        """Every conversation, most recently updated first."""
        with self._errors():
            rows = self.db.execute(
                "SELECT c.id, c.title, c.updated, count(m.seq) FROM conversations c "
                "LEFT JOIN messages m ON m.conversation_id = c.id "
                "GROUP BY c.id ORDER BY c.updated DESC"
            ).fetchall()
        return [ConversationInfo(id, _text(title), _number(updated), n)
                for id, title, updated, n in rows]

    def prompt_history(self, n_prompts: int = HISTORY_PROMPTS,
                       max_chars: int = HISTORY_CHARS) -> list[str]:
        """The user's prompts of every conversation, newest first, each once (its newest
        time): the input's Up/Down history. At most `n_prompts` of the newest prompts are
        looked at, and at most `max_chars` characters kept (a prompt longer than what is
        left is skipped): a history of pasted books stays bounded in memory."""
        with self._errors():
            # keys first: sorting rows that carry their text would sort every pasted book
            keys = self.db.execute(
                "SELECT conversation_id, seq FROM messages WHERE role = 'user' "
                "ORDER BY created DESC, seq DESC LIMIT ?",
                (n_prompts,),
            ).fetchall()
            out: list[str] = []
            seen: set[str] = set()
            left = max_chars
            for conv_id, seq in keys:
                row = self.db.execute(
                    "SELECT length(content), CASE WHEN length(content) <= ?1 THEN content END "
                    "FROM messages WHERE conversation_id = ?2 AND seq = ?3",
                    (left, conv_id, seq),
                ).fetchone()
                if row is None or row[1] is None:  # gone since, or longer than what is left
                    continue
                n_chars, text = row
                text = _text(text)
                if text.strip() and text not in seen:
                    seen.add(text)
                    out.append(text)
                    left -= int(n_chars)
        return out

    @property
    def search_note(self) -> str:
        """Why `search` is a plain substring search ("" when the full-text index is there)."""
        with self._errors():
            have = self.db.execute("SELECT 1 FROM main.sqlite_master WHERE name = ?",
                                   (_FTS,)).fetchone()
        if not FTS5:
            return "this Python's SQLite has no FTS5: plain substring search, slower"
        if not have:  # only read-only: `open` builds it otherwise
            return "no full-text index (an older, read-only history): plain substring search"
        return ""

    def search(self, text: str) -> Found:
        """The conversations whose messages hold every word of `text`, newest first, each
        with its best match (FTS5's bm25 rank, then the newest) as a snippet; bounded as
        app.search says. Without the full-text index, a substring search (LIKE, newest
        match first) that says so in `Found.note`."""
        terms, note = search_terms(text), self.search_note
        query = "" if note else fts_query(terms)
        with self._errors():
            matches = self._substring_matches(terms) if note else self._index_matches(query)
            chosen = [
                (conv_id, _text(title), _number(updated))
                for conv_id, title, updated in self.db.execute(
                    "SELECT id, title, updated FROM conversations ORDER BY updated DESC")
                if conv_id in matches
            ][:SEARCH_LIMIT]
            keys = [matches[conv_id][1] for conv_id, _, _ in chosen]
            shown = (self._substring_snippets(keys, terms) if note
                     else self._index_snippets(keys, query))
        hits = [SearchHit(conv_id, title, updated, matches[conv_id][0], *shown[key])
                for (conv_id, title, updated), key in zip(chosen, keys, strict=True)
                if key in shown]  # not: deleted since by another instance
        scanned = sum(n for n, _ in matches.values())
        return Found(hits, note, more=len(matches) > len(chosen) or scanned >= SEARCH_SCAN)

    def _index_matches(self, query: str) -> dict[str, tuple[int, int]]:
        """conversation -> (its matching messages, the rowid of the best), over the newest
        SEARCH_SCAN matching messages."""
        if not query:
            return {}
        best: dict[str, tuple[int, tuple[float, int]]] = {}
        for conv_id, rowid, rank in self.db.execute(
            f"SELECT m.conversation_id, f.rowid, f.rank FROM (SELECT rowid, rank FROM {_FTS} "
            f"WHERE {_FTS} MATCH ? ORDER BY rowid DESC LIMIT ?) f "
            "JOIN main.messages m ON m.rowid = f.rowid",
            (query, SEARCH_SCAN),
        ):
            n, key = best.get(conv_id, (0, (rank, -rowid)))
            best[conv_id] = (n + 1, min(key, (rank, -rowid)))  # bm25: lower ranks better
        return {conv_id: (n, -key[1]) for conv_id, (n, key) in best.items()}

    def _index_snippets(self, rowids: list[int], query: str) -> dict[int, tuple]:
        """rowid -> (position, role, snippet, marks). One pass over the matches drawing only
        these snippets: `MATCH ? AND rowid IN (...)` would run the query once per rowid (a
        one-letter prefix: 9 s for 200 rows of 50,000 messages, this 0.07 s)."""
        if not rowids:
            return {}
        marks = ", ".join("?" * len(rowids))
        snippets = dict(self.db.execute(
            f"SELECT rowid, CASE WHEN rowid IN ({marks}) THEN "
            f"snippet({_FTS}, 0, ?, ?, '…', ?) END FROM {_FTS} "
            f"WHERE {_FTS} MATCH ? AND rowid >= ? ORDER BY rowid DESC",
            (*rowids, HIT_START, HIT_END, SNIPPET_TOKENS, query, min(rowids)),
        ).fetchall())
        return {
            rowid: (position, _role(role), *parse_snippet(_text(snippets.get(rowid))))
            for rowid, role, position in self.db.execute(
                f"SELECT m.rowid, m.role, {_POSITION} FROM main.messages m "
                f"WHERE m.rowid IN ({marks})",
                rowids,
            )
        }

    def _substring_matches(self, terms: list[str]) -> dict[str, tuple[int, tuple[str, int]]]:
        """conversation -> (its matching messages, (it, the seq of the newest)), over the
        newest SEARCH_SCAN matching messages (LIKE: a scan of every message)."""
        if not terms:
            return {}
        found: dict[str, tuple[int, tuple[str, int]]] = {}
        for conv_id, seq in self.db.execute(
            "SELECT conversation_id, seq FROM messages WHERE "
            + " AND ".join(["content LIKE ? ESCAPE '\\'"] * len(terms))
            + " ORDER BY created DESC, seq DESC LIMIT ?",
            (*map(like_pattern, terms), SEARCH_SCAN),
        ):
            n, newest = found.get(conv_id, (0, (conv_id, seq)))
            found[conv_id] = (n + 1, newest)
        return found

    def _substring_snippets(self, keys: list[tuple[str, int]],
                            terms: list[str]) -> dict[tuple[str, int], tuple]:
        """(conversation, seq) -> (position, role, snippet, marks)."""
        shown = {}
        for key in keys:
            row = self.db.execute(
                f"SELECT {_POSITION}, role, substr(content, 1, {_SNIPPET_READ_CHARS}) "
                "FROM messages m WHERE conversation_id = ? AND seq = ?",
                key,
            ).fetchone()
            if row is not None:
                shown[key] = (row[0], _role(row[1]), *substring_snippet(_text(row[2]), terms))
        return shown

    def delete(self, conv_id: str) -> None:
        """Remove a conversation and its messages."""
        with self._write():
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))

    def rename(self, conv_id: str, title: str) -> None:
        """Give a conversation a new title (its messages and times stay as they are)."""
        with self._write():
            self.db.execute("UPDATE conversations SET title = ? WHERE id = ?",
                            (_storable(title), conv_id))

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _write(self) -> Iterator[None]:
        """One write transaction, holding the write lock from its start (BEGIN IMMEDIATE)."""
        if self.read_only:
            raise StoreError(f"history is read-only: {self.read_only}")
        with self._errors():
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """A failed read or write is one line naming the database (a StoreError)."""
        try:
            yield
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorname", "") in _NOT_A_DATABASE:
                raise _Unreadable(f"{self.path}: {exc}") from None
            raise StoreError(f"{self.path}: {exc}") from None


def _settings_row(conv: Conversation) -> tuple[object, ...]:
    """The values of _SETTINGS_COLUMNS for `conv` (NULL sampling: the app's defaults)."""
    system = _storable(conv.system)
    sampling = conv.sampling
    if sampling is None:
        return (system, None, None, None, None, None)
    p = sampling.params
    return (system, p.temperature, p.top_p, p.top_k, _seed_in(p.seed), sampling.max_tokens)


def _seed_in(seed: int) -> int:
    """A seed (0..2**64-1) as SQLite's signed 64-bit INTEGER holds it: two's complement."""
    return seed - 2**64 if seed >= 2**63 else seed


def _sampling(values: tuple[Any, ...]) -> Sampling | None:
    """Stored sampling columns (temperature, top_p, top_k, seed, max_tokens) as a Sampling;
    None where any is NULL or not valid (another writer's, or a damaged row)."""
    temperature, top_p, top_k, seed, max_tokens = values
    if not isinstance(seed, int):
        return None
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed + 2**64 if seed < 0 else seed)
        return Sampling(params, max_tokens)
    except FlagError:
        return None


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _text(value: object) -> str:
    """A stored value as text: bytes (a BLOB) decoded with replacement characters, NULL empty,
    a number written out."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return _decode(value)
    return "" if value is None else str(value)


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _role(value: object) -> str:
    """A stored role; one the app does not know reads as an answer (shown, never a prompt)."""
    return value if value in ROLES else "assistant"  # type: ignore[return-value]


def _storable(text: str) -> str:
    """`text` as UTF-8 can hold it: a lone surrogate (from a paste) becomes a replacement."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _not_writable(path: Path) -> str:
    """Why the database at `path` cannot be written ("" when it can): the directory (SQLite
    writes its -wal and -shm beside it) or the file itself."""
    directory = path.parent
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    return ""


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """Open `path` for reading only. In WAL mode SQLite needs a -shm beside the file; where it
    cannot make one (the directory is read-only) the file is read as immutable: nobody can
    write it there either."""
    uri = f"{path.resolve().as_uri()}?mode=ro"
    db = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError:
        db.close()
        db = sqlite3.connect(f"{uri}&immutable=1", uri=True, isolation_level=None)
    return db


def _sqlite_header(path: Path) -> bool:
    """Whether `path` is missing, empty or starts like an SQLite database file."""
    try:
        with path.open("rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except FileNotFoundError:
        return True
    except OSError as exc:
        raise StoreError(f"{path}: {exc.strerror or exc}") from None
    return head in (b"", _SQLITE_MAGIC)


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StoreError(
            f"data directory {directory} is a file, not a directory; move the file, or set "
            "STRATA_DATA_DIR to use another directory"
        ) from None
    except NotADirectoryError:
        raise StoreError(
            f"data directory {directory}: a part of its path is a file, not a directory; "
            "set STRATA_DATA_DIR to use another directory"
        ) from None
    except OSError as exc:
        raise StoreError(f"data directory {directory}: {exc.strerror or exc}") from None


def _move_aside(path: Path) -> Path:
    """Rename a file that is not a database of ours (and its companions) to `*.bad-<time>`."""
    bad = aside_path(path)
    try:
        os.replace(path, bad)
        for suffix in _COMPANIONS:
            companion = path.with_name(path.name + suffix)
            if companion.exists():
                os.replace(companion, bad.with_name(bad.name + suffix))
    except OSError as exc:
        raise StoreError(f"{path} is not a database and cannot be moved aside: {exc}") from None
    return bad


def export_markdown(conv: Conversation, directory: Path | None = None) -> Path:
    """Write the conversation as Markdown under `directory` (default: data dir/exports)."""
    directory = directory or data_dir() / "exports"
    path = directory / f"conversation-{conv.id}.md"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(conv.to_markdown(), encoding="utf-8")
    except OSError as exc:
        raise StoreError(f"cannot export to {path}: {exc.strerror or exc}") from None
    return path
