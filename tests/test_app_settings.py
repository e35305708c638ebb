"""Settings kept between runs (app/settings.py), and a conversation's own system prompt and
sampling: the TOML file, its bad forms, the command line over it, the store's columns
(migration 5), and the app driven by the Textual pilot on the real engine (`tiny` preset)."""

from __future__ import annotations

import os
import sqlite3
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_app_flows import async_test
from test_app_persistence import said
from test_app_store import run_read_only
from textual.notifications import Notify
from textual.widgets import Checkbox, Input, TextArea

from app.app import StrataApp
from app.config import add_chat_args, chat_config
from app.scenes import wait_ready, wait_until
from app.settings import (
    MAX_SETTINGS_BYTES,
    SETTINGS_NAME,
    Settings,
    SettingsError,
    SettingsKeeper,
    read_settings,
    toml_string,
)
from app.store import MIGRATIONS, Store
from app.widgets.chat_settings import ChatSettingsScreen, SamplingForm
from app.widgets.timing_panel import TimingPanel
from engine.cli import OneLineParser
from engine.config import EngineOptions, LoanFlags
from engine.errors import FlagError
from engine.request.conversation import Conversation, Message, Sampling
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop

SIZE = (120, 40)
SAMPLED = Sampling(SamplingParams(temperature=0.5, top_p=0.9, top_k=7, seed=2**64 - 1), 5)
FLAGS = LoanFlags.make(elastic_loan=True, repeat_loan=True, repeat_auto=True)


def parse(*argv: str):  # type: ignore[no-untyped-def]
    parser = OneLineParser(prog="strata chat")
    add_chat_args(parser)
    return parser.parse_args(list(argv))


def note_of(notes: list) -> list[str]:
    return said(notes, "Settings")


# -- the file ------------------------------------------------------------------------------------
def test_settings_are_written_as_toml_and_read_back_equal() -> None:
    kept = Settings(theme="nord", dashboard=False, system='say "hi"\\\n\t\x7f\x00 é 😀',
                    sampling=SAMPLED, flags=FLAGS)
    text = kept.to_toml()
    assert tomllib.loads(text)["conversation"]["seed"] == 2**64 - 1
    assert Settings.from_toml(text) == kept
    assert Settings.from_toml(Settings().to_toml()) == Settings()
    assert "[loan]" not in Settings().to_toml()  # no flags until the panel applies some
    assert Settings.from_toml("") == Settings()  # every key may be missing


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_is_a_toml_string_tomllib_reads_back(text: str) -> None:
    read = tomllib.loads(f"s = {toml_string(text)}\n")["s"]
    # a lone surrogate cannot be in a UTF-8 file: it reads as U+FFFD, as the history keeps it
    assert read == "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


@pytest.mark.parametrize(("content", "why"), [
    (b"theme = [", "not TOML"),
    (b"dashboard = 1", "dashboard 1 must be true or false"),
    (b"colour = 'red'", "unknown key 'colour'"),
    (b"[conversation]\ntemperature = -1", "temperature -1 must be a finite number >= 0"),
    (b"[conversation]\nmax_tokens = 0", "max tokens 0 must be an integer in 1.."),
    (b"[conversation]\ntop_k = 1.5", "top_k 1.5 must be an integer"),
    (b"[loan]\nrepeat_min_tokens = 3", "repeat_min_tokens 3 must be in 256.."),
    (b"[loan]\nelastic_loan = 'yes'", "elastic_loan 'yes' must be true or false"),
    (b"theme = 'no-such-theme'", "theme 'no-such-theme' is not one of Textual's themes"),
    (b"conversation = 3", "conversation must be a table"),
    (b"\xff\xfe theme", "is not UTF-8 text"),
    (b"# " + b"x" * MAX_SETTINGS_BYTES, f"more than the limit of {MAX_SETTINGS_BYTES:,}"),
])
def test_a_bad_file_is_moved_aside_and_the_defaults_apply(tmp_path: Path, content: bytes,
                                                          why: str) -> None:
    path = tmp_path / SETTINGS_NAME
    path.write_bytes(content)
    kept, note = read_settings(path)
    assert kept == Settings()
    assert "\n" not in note and why in note and str(path) in note
    (moved,) = tmp_path.glob(f"{SETTINGS_NAME}.bad-*")
    assert moved.read_bytes() == content and not path.exists()
    assert f"moved to {moved.name}" in note


def test_every_problem_of_a_file_is_named_at_once() -> None:
    with pytest.raises(SettingsError) as err:
        Settings.from_toml("dashboard = 'no'\nx = 1\n[conversation]\ntop_p = 2\nseed = -1\n")
    line = str(err.value)
    for part in ("dashboard 'no'", "unknown key 'x'", "top_p 2 must be a number in (0, 1]",
                 "seed -1 must be an integer in 0..2**64-1"):
        assert part in line


@pytest.mark.parametrize(("make", "kind"), [(Path.mkdir, "a directory"),
                                            (os.mkfifo, "a FIFO (named pipe)")])
def test_a_directory_or_a_fifo_in_the_files_place_is_moved_aside(tmp_path: Path, make,  # type: ignore[no-untyped-def]
                                                                 kind: str) -> None:
    make(tmp_path / SETTINGS_NAME)  # a FIFO with no writer: never opened to block
    kept, note = read_settings(tmp_path / SETTINGS_NAME)
    assert kept == Settings() and f"is {kind}" in note
    assert len(list(tmp_path.glob(f"{SETTINGS_NAME}.bad-*"))) == 1


def test_settings_past_the_cap_are_never_written(tmp_path: Path) -> None:
    path = tmp_path / SETTINGS_NAME
    keeper = SettingsKeeper(Settings(), path)
    keeper.change(theme="nord")
    with pytest.raises(SettingsError, match="shorten the default system prompt"):
        keeper.change(system="x" * MAX_SETTINGS_BYTES)
    assert read_settings(path) == (Settings(theme="nord"), "")  # the file as it was


def test_a_settings_file_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    keeper = SettingsKeeper(Settings(), tmp_path / "file" / SETTINGS_NAME)
    with pytest.raises(SettingsError, match="a file is where the directory .* should be"):
        keeper.change(dashboard=False)
    assert keeper.settings.dashboard is False  # kept for this run


# -- the command line over the file ----------------------------------------------------------------
def test_the_command_line_and_strata_prefill_win_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    (tmp_path / SETTINGS_NAME).write_text(Settings(sampling=SAMPLED, flags=FLAGS).to_toml())
    config = chat_config(parse("--model", "tiny"))
    assert (config.params, config.max_new) == (SAMPLED.params, SAMPLED.max_tokens)
    assert config.flags == FLAGS and config.default_flags is not None
    assert config.settings_path == tmp_path / SETTINGS_NAME and config.settings_note == ""
    # given, even at its default value, an option wins; the others stay the file's
    config = chat_config(parse("--model", "tiny", "--temperature", "0", "--max-new", "9"))
    assert config.params == SamplingParams(0.0, top_k=7, top_p=0.9, seed=2**64 - 1)
    assert config.max_new == 9
    assert chat_config(parse("--model", "tiny", "--plain")).flags == LoanFlags()
    monkeypatch.setenv("STRATA_PREFILL_ELASTIC_LOAN", "0")
    config = chat_config(parse("--model", "tiny"))
    assert config.flags == LoanFlags() and config.default_flags is None
    assert "win over the file" in " ".join(parse_help())


def parse_help() -> list[str]:
    parser = OneLineParser(prog="strata chat")
    add_chat_args(parser)
    return parser.format_help().split()


# -- the store (migration 5) -----------------------------------------------------------------------
def test_a_conversations_system_prompt_and_sampling_are_stored_with_it(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "c.sqlite3")
    conv = Conversation(system="be brief", sampling=SAMPLED)
    store.configure(conv)  # no message yet: no row, nothing written
    assert store.list() == []
    store.append(conv, Message("user", "hi"))
    loaded = store.load(conv.id)
    assert loaded is not None and (loaded.system, loaded.sampling) == ("be brief", SAMPLED)
    conv.system, conv.sampling = "", None
    store.configure(conv)
    loaded = store.load(conv.id)
    assert loaded is not None and (loaded.system, loaded.sampling) == ("", None)
    # a change the store refused goes with the next message
    conv.system = "again"
    store.append(conv, Message("assistant", "hello"))
    assert store.load(conv.id).system == "again"  # type: ignore[union-attr]


def test_stored_sampling_that_is_not_valid_reads_as_the_defaults(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "c.sqlite3")
    conv = Conversation(sampling=SAMPLED)
    store.append(conv, Message("user", "hi"))
    for column, value in (("temperature", "hot"), ("top_p", 7.0), ("max_tokens", 0),
                          ("seed", 1.5)):
        store.configure(conv)
        store.db.execute(f"UPDATE conversations SET {column} = ?", (value,))
        loaded = store.load(conv.id)
        assert loaded is not None and loaded.sampling is None, column


def schema_4(path: Path) -> None:
    """A database as the app before migration 5 left it, with one exchange."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version in range(1, 5):
        for statement in MIGRATIONS[version]:
            db.execute(statement)
        db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    db.execute("INSERT INTO conversations VALUES ('abc', 'old', 1.0, 2.0)")
    db.execute("INSERT INTO messages (conversation_id, seq, role, content, created) "
               "VALUES ('abc', 0, 'user', 'hi', 1.0)")
    db.commit()
    db.close()


def test_a_database_from_before_migration_5_reads_with_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    schema_4(path)
    proc = run_read_only(tmp_path, """
        import sys
        from pathlib import Path
        from app.store import Store

        store = Store.open(Path(sys.argv[1]))
        conv = store.load("abc")
        print(bool(store.read_only), repr(conv.system), conv.sampling, conv.messages[0].content)
    """, str(path))  # read-only, an old schema cannot be migrated: a view stands in
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["True '' None hi"]
    store = Store.open(path)  # writable: migrated
    loaded = store.load("abc")
    assert loaded is not None and (loaded.system, loaded.sampling) == ("", None)
    assert [m.content for m in loaded.messages] == ["hi"]


def test_the_system_prompt_is_the_first_message_rendered() -> None:
    conv = Conversation(system="be brief")
    conv.add("user", "hi")
    assert conv.as_dicts() == [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hi"}]
    assert "## system prompt\n\nbe brief" in conv.to_markdown()
    assert Conversation().as_dicts() == []
    with pytest.raises(FlagError, match="max tokens 0"):
        Sampling(max_tokens=0)


# -- the app -----------------------------------------------------------------------------------
def app_of(tmp_path: Path, *argv: str) -> StrataApp:
    """The app as `strata chat` builds it (the settings file under STRATA_CONFIG_DIR)."""
    config = chat_config(parse("--model", "tiny", *argv))
    return StrataApp(config, store=Store.open(tmp_path / "conversations.sqlite3"))


async def send(pilot, text: str) -> None:  # type: ignore[no-untyped-def]
    app = pilot.app
    n = len(app.conv.messages)
    await pilot.press(*text, "enter")
    await wait_until(pilot, lambda: not app.running and len(app.conv.messages) == n + 2)


async def edit_settings(pilot, system: str | None = None, default: bool = False,  # type: ignore[no-untyped-def]
                        **values: str) -> ChatSettingsScreen:
    """F4, type the system prompt, fill in the values, tick the default box; the screen (not
    yet applied)."""
    await pilot.press("f4")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, ChatSettingsScreen))
    screen = pilot.app.screen
    if system is not None:
        area = screen.query_one("#system-prompt", TextArea)
        area.clear()
        await pilot.press(*system)
    for key, text in values.items():
        screen.query_one(f"#sampling-{key}", Input).value = text
    screen.query_one(Checkbox).value = default
    return screen


async def apply(pilot) -> None:  # type: ignore[no-untyped-def]
    await pilot.press("ctrl+s")
    await wait_until(pilot, lambda: pilot.app.screen is pilot.app.default_screen)


@async_test
async def test_settings_persist_across_two_app_runs(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path / "config"))
    app = app_of(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        app.theme = "nord"  # what ctrl+t's picker does
        await pilot.press("f2")
        flags, options = app.flags_in_force()  # type: ignore[misc]
        app.request_flags(flags.with_changes(head_loan=False, repeat_min_tokens=4096), options)
        await edit_settings(pilot, "Be brief.", default=True, temperature="0.5", top_k="7",
                            seed="3", max_tokens="5")
        await apply(pilot)
        await pilot.press("ctrl+q")
    saved = tomllib.loads((tmp_path / "config" / SETTINGS_NAME).read_text())
    assert saved["theme"] == "nord" and saved["dashboard"] is False
    assert saved["conversation"] == {"system_prompt": "Be brief.", "temperature": 0.5,
                                     "top_p": 0.95, "top_k": 7, "seed": 3, "max_tokens": 5}
    assert saved["loan"]["head_loan"] is False and saved["loan"]["repeat_min_tokens"] == 4096

    again = app_of(tmp_path)
    async with again.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert again.theme == "nord" and not again.show_dashboard
        in_force = again.flags_in_force()
        assert in_force is not None and in_force[0] == flags.with_changes(
            head_loan=False, repeat_min_tokens=4096)
        assert again.conv.system == "Be brief."
        assert again.conv.sampling == Sampling(SamplingParams(0.5, top_k=7, seed=3), 5)
        await send(pilot, "hello")
        done = again.query_one(TimingPanel).done
        assert done is not None and done.generated <= 5


@async_test
async def test_a_corrupt_settings_file_is_one_notification_and_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    (tmp_path / SETTINGS_NAME).write_text("theme = 'nord'\ndashboard = 'off'\n")
    app = app_of(tmp_path)
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        (note,) = note_of(notes)
        assert "dashboard 'off' must be true or false" in note and "moved to" in note
        assert app.theme == "textual-dark" and app.show_dashboard
        assert app.conv.sampling == Sampling()
    assert not (tmp_path / SETTINGS_NAME).exists()  # nothing changed, nothing written
    assert len(list(tmp_path.glob(f"{SETTINGS_NAME}.bad-*"))) == 1


@async_test
async def test_reset_from_the_palette_puts_every_setting_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    (tmp_path / SETTINGS_NAME).write_text(
        Settings(theme="nord", dashboard=False, system="x", sampling=SAMPLED,
                 flags=LoanFlags.make(elastic_loan=True)).to_toml())
    app = app_of(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert app.theme == "nord" and app.flags_in_force()[0].elastic_loan  # type: ignore[index]
        await pilot.press("ctrl+p", *"reset to defaults")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.theme == "textual-dark")
        assert app.show_dashboard
        assert app.flags_in_force()[0] == app.config.default_flags  # type: ignore[index]
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.conv.sampling == Sampling())
        assert app.conv.system == ""
    assert read_settings(tmp_path / SETTINGS_NAME) == (Settings(), "")


@async_test
async def test_the_dialog_shows_the_samplers_refusals_and_stays_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    app = app_of(tmp_path, "--max-new", "8")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        screen = await edit_settings(pilot, temperature="-1", top_p="2", max_tokens="0")
        await pilot.press("ctrl+s")
        await pilot.pause(0.1)
        assert app.screen is screen
        error = str(screen.query_one("#sampling-error").render())
        assert error.splitlines() == [
            "--temperature -1.0 must be a finite number >= 0 (0 is greedy)",
            "--top-p 2.0 must be a number in (0, 1]"]
        screen.query_one("#sampling-top_p", Input).value = "0.5"
        screen.query_one("#sampling-temperature", Input).value = "1"
        screen.query_one(SamplingForm).read()
        assert str(screen.query_one("#sampling-error").render()).startswith("max tokens 0 must")
        await pilot.press("escape")  # closes without a change
        await pilot.pause(0.1)
        assert app.screen is app.default_screen and app.conv.sampling == Sampling(max_tokens=8)


def reference(prompt: str, params: SamplingParams, max_new: int, system: str = "") -> str:
    loop = ServeLoop.create(EngineOptions(model="tiny"))
    try:
        return loop.chat(Conversation(system=system), prompt, params, max_new).text
    finally:
        loop.close()


@async_test
async def test_max_tokens_from_the_dialog_caps_the_next_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    app = app_of(tmp_path, "--plain", "--max-new", "16")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await edit_settings(pilot, max_tokens="3")
        await apply(pilot)
        await send(pilot, "hello")
        done = app.query_one(TimingPanel).done
        assert done is not None and done.generated == 3
        reply = app.conv.messages[-1].content
    assert reply == reference("hello", SamplingParams(), 3) != reference(
        "hello", SamplingParams(), 16)


@async_test
async def test_a_seed_from_the_dialog_gives_the_same_sampled_reply_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    app = app_of(tmp_path, "--plain", "--max-new", "8")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        # made the default: each new conversation takes it
        await edit_settings(pilot, default=True, temperature="1", seed="7")
        await apply(pilot)
        await send(pilot, "hello")
        first = app.conv.messages[-1].content
        await pilot.press("ctrl+n")
        await send(pilot, "hello")
        assert app.conv.messages[-1].content == first
        stored = app.store.load(app.conv.id)  # type: ignore[union-attr]
        assert stored is not None and stored.sampling == app.conv.sampling
    assert first == reference("hello", SamplingParams(temperature=1.0, seed=7), 8)
    assert first != reference("hello", SamplingParams(temperature=1.0, seed=8), 8)


@async_test
async def test_the_system_prompt_is_stored_and_rendered_into_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    app = app_of(tmp_path, "--plain", "--max-new", "4")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await edit_settings(pilot, "You are terse.")
        await apply(pilot)
        await send(pilot, "hello")
        done = app.query_one(TimingPanel).done
        loop = app.link.loop
        assert done is not None and isinstance(loop, ServeLoop)
        tok = loop.rt.model.tokenizer
        rendered = tok.render_chat(app.conv.as_dicts()[:2], add_generation_prompt=True)
        assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
        bare = Conversation()
        bare.add("user", "hello")
        assert done.prompt_tokens == len(tok.encode(rendered)) > len(loop.prompt_ids(bare))
        stored = app.store.load(app.conv.id)  # type: ignore[union-attr]
        assert stored is not None and stored.system == "You are terse."
        assert app.conv.messages[-1].content == reference(
            "hello", SamplingParams(), 4, system="You are terse.")


@async_test
async def test_saved_flags_the_guards_refuse_leave_the_defaults_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_nomtp_path: Path
) -> None:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path))
    (tmp_path / SETTINGS_NAME).write_text(Settings(flags=LoanFlags.make(
        elastic_loan=True, mtp_loan=True)).to_toml())
    config = chat_config(parse("--model", str(tiny_nomtp_path)))  # no MTP: no MTP loan
    app = StrataApp(config, store=Store.open(tmp_path / "conversations.sqlite3"))
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        (note,) = note_of(notes)
        assert note.startswith("The loan flags in the settings are refused") and "MTP" in note
        assert app.flags_in_force()[0] == config.default_flags  # type: ignore[index]
        assert app.return_code is None  # the app runs
