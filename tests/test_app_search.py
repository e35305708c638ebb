"""Full-text search in the history: the FTS5 index the store keeps (migration 6), what a search
finds and how it is bounded, and the conversation list's search box (Textual pilot)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_app_flows import SIZE, async_test, make_app
from test_app_store import DB, conversation, run_read_only, store_all
from textual.app import App, ComposeResult
from textual.widgets import Input, Label, OptionList

import app.store as store_module
from app.scenes import wait_ready, wait_until
from app.screens import ConversationsScreen, OpenAt
from app.search import SEARCH_LIMIT, fts_query, parse_snippet, substring_snippet
from app.store import MIGRATIONS, SCHEMA_VERSION, Store
from app.widgets.chat_log import MessageView
from engine.request.conversation import Conversation, Message


def stored(store: Store, *texts: str, updated: float | None = None) -> Conversation:
    """A conversation of `texts` (prompt, answer, ...) in `store`, updated at `updated`."""
    conv = conversation(*texts)
    store_all(store, conv)
    if updated is not None:
        store.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (updated, conv.id))
    return conv


def index_is_sound(store: Store) -> None:
    """FTS5's own check: the index holds exactly what the messages hold."""
    store.db.execute("INSERT INTO messages_fts (messages_fts, rank) VALUES ('integrity-check', 1)")


def test_the_soundness_check_sees_an_index_out_of_step(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    stored(store, "hello world", "hi")
    index_is_sound(store)
    store.db.execute("DROP TRIGGER messages_fts_update")
    store.db.execute("UPDATE messages SET content = 'changed behind its back'")
    with pytest.raises(sqlite3.DatabaseError):
        index_is_sound(store)


def marked(hit) -> list[str]:
    return [hit.snippet[start:end] for start, end in hit.marks]


# -- what a search finds -------------------------------------------------------------------
def test_search_finds_words_in_prompts_and_answers_and_where_they_are(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    assert store_module.FTS5 and store.search_note == ""  # this Python's SQLite has FTS5
    conv = stored(store, "How does Quicksort pick its pivot?", "It partitions around a pivot.",
                  "And in a café?", "The same: the pivot is the median of three.")
    stored(store, "something else entirely", "yes")
    (hit,) = store.search("quicksort").hits  # case folded
    assert (hit.conv_id, hit.role, hit.message, hit.n_hits) == (conv.id, "user", 0, 1)
    assert marked(hit) == ["Quicksort"] and hit.title == conv.title
    (hit,) = store.search("median").hits  # an answer's words too
    assert (hit.role, hit.message) == ("assistant", 3)
    assert store.load(conv.id).messages[hit.message].content.endswith("median of three.")
    (hit,) = store.search("cafe").hits  # diacritics folded
    assert marked(hit) == ["café"] and hit.message == 2
    (hit,) = store.search("quick piv").hits  # every word, each a prefix
    assert hit.message == 0 and marked(hit) == ["Quicksort", "pivot"]
    assert store.search("sort").hits == []  # a word's start, not its middle
    assert store.search("pivot nowhere").hits == []


def test_conversations_come_newest_first_each_with_its_best_match(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    old = stored(store, "a kettle whistles", "the kettle boils; kettle, kettle", updated=100.0)
    new = stored(store, "kettle?", "no", updated=200.0)
    mid = stored(store, "no match here", "a kettle", updated=150.0)
    found = store.search("kettle")
    assert [h.conv_id for h in found.hits] == [new.id, mid.id, old.id] and not found.more
    best = found.hits[2]
    assert best.n_hits == 2 and best.message == 1  # more of the word ranks first (bm25)
    assert marked(best).count("kettle") >= 3


@pytest.mark.parametrize("query", [
    "NEAR(", 'NEAR("a" "b")', '"unbalanced', 'un"balanced', "AND", "OR NOT", "*", "^x", "-x",
    "col:x", "content:pivot", "(", ")", "{a b}", '""', "\\", "'", "a'b", "%", "_", "+", ".",
    "x" * 5000, "\x00", "\ud800", "🙂", "\u200b", "ß",
])
def test_fts_syntax_and_odd_characters_are_searched_as_text_never_raise(
    tmp_path: Path, query: str
) -> None:
    store = Store.open(tmp_path / DB)
    stored(store, 'Mergesort NEAR( "x and 100% of C++ (col:x) 🙂 straße', "fine")
    found = store.search(query)  # no exception is the point; what they find:
    expect = {"NEAR(": 1, '"unbalanced': 0, "col:x": 1, "🙂": 0, "ß": 0, "AND": 1, "(": 0}
    if query in expect:
        assert len(found.hits) == expect[query], query


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=st.text(max_size=40))
def test_any_text_is_a_valid_search(tmp_path: Path, query: str) -> None:
    path = tmp_path / "h.sqlite3"
    store = Store.open(path)
    if not store.list():
        stored(store, "alpha beta gamma", "delta")
    try:
        store.search(query)
        assert fts_query(query.split()).count('"') % 2 == 0  # every phrase closed
    finally:
        store.close()


def test_the_index_follows_streamed_rewrites_withdrawals_and_deletes(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    conv = Conversation()
    prompt = conv.add("user", "tell me about otters")
    p_seq = store.append(conv, prompt)
    answer = Message("assistant", "Otters are")
    a_seq = store.append(conv, answer, reply_to=p_seq, partial=True)
    store.update(conv.id, a_seq, Message("assistant", "Otters are weasels"), partial=True)
    store.update(conv.id, a_seq, Message("assistant", "Otters are mustelids"))
    assert store.search("weasels").hits == []  # the text replaced is forgotten
    assert store.search("mustelids").hits[0].message == 1
    index_is_sound(store)
    store.withdraw(conv.id, a_seq)
    assert store.search("mustelids").hits == []
    other = stored(store, "otters again", "yes")
    store.delete(conv.id)  # its messages go by ON DELETE CASCADE: the triggers see them
    assert [h.conv_id for h in store.search("otters").hits] == [other.id]
    index_is_sound(store)


def test_results_are_bounded_and_say_so(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    store.db.execute("PRAGMA synchronous = OFF")  # 400 commits: no fsync each
    for i in range(SEARCH_LIMIT + 5):
        stored(store, f"needle number {i}", "ok", updated=float(i))
    found = store.search("needle")
    assert len(found.hits) == SEARCH_LIMIT and found.more
    assert found.hits[0].snippet == f"needle number {SEARCH_LIMIT + 4}"  # the newest first
    assert not store.search("needle 7").more


# -- schema: migrated, repaired, checked ---------------------------------------------------
def old_database(path: Path, version: int, *texts: str) -> None:
    """A database as the app before the index wrote it (migrations 1..version), with rows."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for v in range(1, version + 1):
        for statement in MIGRATIONS[v]:
            db.execute(statement)
        db.execute("INSERT INTO schema_version VALUES (?)", (v,))
    db.execute("INSERT INTO conversations (id, title, created, updated) "
               "VALUES ('old', 'from before', 1, 2)")
    for seq, text in enumerate(texts):
        db.execute("INSERT INTO messages (conversation_id, seq, role, content, created) "
                   "VALUES ('old', ?, ?, ?, 1)", (seq, ("user", "assistant")[seq % 2], text))
    db.commit()
    db.close()


def test_an_old_database_is_migrated_and_its_rows_are_searchable(tmp_path: Path) -> None:
    path = tmp_path / DB
    old_database(path, 4, "an ancient prompt about lighthouses", "lighthouses guide ships")
    store = Store.open(path)
    assert store.version == SCHEMA_VERSION and store.moved_aside is None
    (hit,) = store.search("lighthouse").hits
    assert (hit.conv_id, hit.n_hits, hit.title) == ("old", 2, "from before")
    index_is_sound(store)
    store.close()
    again = Store.open(path)  # a healthy migrated database: opened as it is, not moved aside
    assert again.moved_aside is None and len(again.search("ships").hits) == 1
    assert [p.name for p in tmp_path.iterdir() if ".bad-" in p.name] == []


def test_a_database_without_its_index_gets_it_rebuilt(tmp_path: Path) -> None:
    """As one written where SQLite has no FTS5 leaves it: version 6, no index, no triggers,
    messages the index never saw."""
    path = tmp_path / DB
    store = Store.open(path)
    stored(store, "written with the index", "ok")
    store.db.execute("DROP TABLE messages_fts")
    for trigger in store_module._FTS_TRIGGERS:
        store.db.execute(f"DROP TRIGGER {trigger}")
    stored(store, "written without it: zeppelins", "ok")
    store.close()
    store = Store.open(path)
    assert store.moved_aside is None and store.search_note == ""
    assert len(store.search("zeppelins").hits) == 1 and len(store.search("index").hits) == 1
    index_is_sound(store)


def test_a_gap_in_the_versions_is_filled_later(tmp_path: Path) -> None:
    """A version not recorded is applied though a later one is (the index, 6, landed before
    migration 5 existed): here 4 is taken out again, its column with it."""
    path = tmp_path / DB
    store = Store.open(path)
    stored(store, "kept", "ok")
    store.close()
    db = sqlite3.connect(path)
    db.execute("DELETE FROM schema_version WHERE version = 4")
    db.execute("ALTER TABLE messages DROP COLUMN partial")
    db.commit()
    db.close()
    store = Store.open(path)
    assert store.moved_aside is None and store.version == SCHEMA_VERSION
    assert sorted(r[0] for r in store.db.execute("SELECT version FROM schema_version")) == \
        sorted(MIGRATIONS)
    assert len(store.search("kept").hits) == 1
    index_is_sound(store)


READ_ONLY_SEARCH = """
    import sys
    from pathlib import Path
    from app.store import Store
    store = Store.open(Path(sys.argv[1]))
    print(store.read_only)
    print(repr(store.search_note))
    for query in sys.argv[2:]:
        print(query, [(h.message, h.snippet, h.marks) for h in store.search(query).hits])
"""


def test_a_read_only_history_is_searched_with_its_index(tmp_path: Path) -> None:
    path = tmp_path / DB
    store = Store.open(path)
    stored(store, "read only but searchable", "indeed")
    store.close()
    proc = run_read_only(tmp_path, READ_ONLY_SEARCH, str(path), "searchable", "nothing")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{tmp_path} is not writable", "''",
        "searchable [(0, 'read only but searchable', ((14, 24),))]", "nothing []"]


def test_an_older_read_only_history_falls_back_to_a_substring_search(tmp_path: Path) -> None:
    """Read-only, an index cannot be built: LIKE, with % and _ taken literally, and a note."""
    path = tmp_path / DB
    old_database(path, 2, "a 50% discount on snake_case", "500 percent? no", "snakeXcase")
    proc = run_read_only(tmp_path, READ_ONLY_SEARCH, str(path), "50%", "e_c", "DISCOUNT")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{tmp_path} is not writable",
        "'no full-text index (an older, read-only history): plain substring search'",
        "50% [(0, 'a 50% discount on snake_case', ((2, 5),))]",
        "e_c [(0, 'a 50% discount on snake_case', ((22, 25),))]",
        "DISCOUNT [(0, 'a 50% discount on snake_case', ((6, 14),))]"]


# -- snippets ------------------------------------------------------------------------------
def test_snippets_are_one_line_with_their_marks() -> None:
    text, marks = parse_snippet("…the \ue000pivot\ue001 is\nthe \ue000median\ue001")
    assert text == "…the pivot is the median" and [text[s:e] for s, e in marks] == [
        "pivot", "median"]
    long = "x " * 200 + "Needle\tin a haystack" + " y" * 200
    text, marks = substring_snippet(long, ["needle", "HAY"])
    assert text.startswith("…") and text.endswith("…") and "\t" not in text
    assert [text[s:e] for s, e in marks] == ["Needle", "hay"]


# -- the conversation list (Textual pilot) -------------------------------------------------
class ListApp(App[None]):
    """The conversation list alone, over a real store: what it dismisses with is kept."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.opened: list[OpenAt | None] = []

    def compose(self) -> ComposeResult:
        yield Label("behind")

    def on_mount(self) -> None:
        self.push_screen(ConversationsScreen(self.store.list(), None, self.store.search),
                         self.opened.append)


@async_test
async def test_typing_in_the_list_searches_the_messages(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB)
    lamp = stored(store, "about lamps", "an Argand lamp burns oil", updated=300.0)
    stored(store, "argand by title?", "no: by content", updated=200.0)
    other = stored(store, "unrelated", "words", updated=100.0)
    app = ListApp(store)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        assert isinstance(screen, ConversationsScreen)
        await pilot.press(*"argand")
        await pilot.pause()
        shown = [c.id for c in screen.shown()]
        assert shown[:1] == [lamp.id] and other.id not in shown
        hit = screen.hit(lamp.id)
        assert hit is not None and hit.message == 1
        options = screen.query_one(OptionList)
        prompt = options.get_option_at_index(0).prompt
        assert "assistant: an Argand lamp burns oil" in prompt.plain
        assert any(span.style == ConversationsScreen.HIT_STYLE for span in prompt.spans)
        await pilot.press(*" zzzz")  # no message holds both words: nothing
        await pilot.pause()
        assert screen.shown() == [] and "nothing matches" in str(
            options.get_option_at_index(0).prompt)
        search = screen.query_one("#conv-search", Input)
        search.value = '"argand'  # FTS5 syntax (an unbalanced quote): searched as a word
        await pilot.pause()
        assert screen.shown()[0].id == lamp.id
        await pilot.press("enter")
        await pilot.pause()
    assert app.opened == [OpenAt(lamp.id, 1)]


@async_test
async def test_the_app_opens_a_found_conversation_at_its_match(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "conversations.sqlite3")
    texts = [f"filler prompt {i}\n" + "line\n" * 8 for i in range(10)]
    target = stored(store, *texts[:4], "the one about a narwhal", *texts[4:], updated=100.0)
    stored(store, "the latest", "conversation", updated=200.0)
    store.close()
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert app.conv.id != target.id
        await pilot.press("ctrl+o")
        await pilot.pause()
        await pilot.press(*"narwhal", "enter")
        await wait_until(pilot, lambda: app.conv.id == target.id and isinstance(
            app.focused, MessageView))
        await pilot.pause()
        focused = app.focused
        assert focused.content == "the one about a narwhal"  # the match, marked by the focus
        log, top = focused.parent, focused.virtual_region.y
        assert 0 < log.scroll_y <= top < log.scroll_y + log.scrollable_content_region.height
