"""The chat app as a client of `strata serve` (`strata chat --connect URL`): chat through the
API, the dashboard from /v1/events, flag toggles through /v1/flags, Esc cancelling on the
server, and a server that cannot be used (not there, a wrong key) as one line."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from gates import Gate
from servers import LOAN, Running, fresh_answer, running
from test_app_flows import SIZE, async_test, send, toggle_first_switch
from textual.events import Paste
from textual.notifications import Notify

from app.app import StrataApp
from app.config import ChatConfig, add_chat_args, chat_config
from app.remote_link import RemoteLink
from app.scenes import sample_paste, wait_ready, wait_until
from app.store import Store
from app.widgets.flags_panel import FlagsPanel
from app.widgets.prompt_input import Composer
from app.widgets.timing_panel import TimingPanel
from app.widgets.vram_bar import VramBar
from engine.cli import OneLineParser
from engine.config import EngineOptions, LoanFlags
from engine.errors import StrataError
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.server.config import ServerConfig
from engine.server.runner import ServerThread
from engine.server.service import Service
from engine.trace.events import EventBus, PrefillProgress, RequestDone

MAX_NEW = 12


@pytest.fixture(scope="module")
def server(demo_path: Path) -> Iterator[Running]:
    with running(str(demo_path)) as r:
        yield r


def remote_app(tmp_path: Path, url: str, api_key: str | None = None) -> StrataApp:
    config = ChatConfig(EngineOptions(), LoanFlags(), max_new=MAX_NEW, connect=url,
                        api_key=api_key)
    return StrataApp(config, store=Store.open(tmp_path / "conversations.sqlite3"),
                     export_dir=tmp_path / "exports")


@async_test
async def test_the_app_chats_through_the_server(tmp_path: Path, server: Running,
                                                demo_path: Path) -> None:
    loop = ServeLoop.create(EngineOptions(model=str(demo_path), **LOAN))
    conv = Conversation()
    expected = [loop.chat(conv, p, max_new=MAX_NEW).text for p in ("What is a cat?",
                                                                  "What is a dog?")]
    app = remote_app(tmp_path, server.url)
    assert isinstance(app.link, RemoteLink)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert "4 layers · 32 experts" in app.sub_title  # the server's Ready event
        await send(pilot, "What is a cat?")
        await send(pilot, "What is a dog?")
        await wait_until(pilot, lambda: app.query_one(TimingPanel).done is not None)
        assert app.query_one(VramBar).ledger is not None
        panel = app.query_one(FlagsPanel)
        assert panel.flags.elastic_loan and panel.options.spec == LOAN["spec"]  # the server's
        assert [m.content for m in app.conv.messages[1::2]] == expected
        assert [m.content for m in app.store.load(app.conv.id).messages[1::2]] == expected


@async_test
async def test_flag_toggles_go_through_the_servers_guards(tmp_path: Path,
                                                          server: Running) -> None:
    app = remote_app(tmp_path, server.url)
    notes: list[Notify] = []
    async with app.run_test(size=SIZE, message_hook=notes.append) as pilot:
        await wait_ready(pilot)
        panel = app.query_one(FlagsPanel)
        status = panel.query_one("#flags-status")
        before = app.flags_in_force()
        assert before is not None and before[0].sub_options_on()
        switch = await toggle_first_switch(pilot)  # the master switch off: its sub-options too
        await wait_until(pilot, lambda: "applies from the next message" in str(status.render()))
        assert switch.value is False and not server.loop.flags.elastic_loan
        assert server.loop.flags.sub_options_on() == () and not refused(notes)
        app.request_flags(*before)  # the server's flags back as they were
        assert server.loop.flags == before[0]
        flags, options = app.flags_in_force()
        app.request_flags(flags.with_changes(repeat_min_tokens=512), options)
        assert server.loop.flags.repeat_min_tokens == 512  # accepted: the server's from now on
        assert app.link.loop.flags.repeat_min_tokens == 512
        assert "applies from the next message" in str(status.render())
        app.request_flags(flags, options.with_changes(spec=8))  # needs a restart
        await pilot.pause()
        assert "--spec 8 needs a verifier" in refused(notes)[-1]
        app.request_flags(flags, options)
        assert server.loop.flags == flags


def refused(notes: list[object]) -> list[str]:
    """The messages of the 'Flags refused' notifications."""
    return [n.notification.message for n in notes
            if isinstance(n, Notify) and n.notification.title == "Flags refused"]


@async_test
async def test_escape_cancels_the_request_on_the_server(tmp_path: Path, server: Running,
                                                        demo_path: Path) -> None:
    app = remote_app(tmp_path, server.url)
    seen: list[object] = []
    server.bus.subscribe(seen.append)
    gate = Gate(server.bus, lambda e: isinstance(e, PrefillProgress) and e.chunk < e.n_chunks)
    text = sample_paste(30)  # ~630 tokens: three chunks of 256
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        app.post_message(Paste(text))
        await wait_until(pilot, lambda: bool(composer.pastes))
        app.simulate_key("enter")
        await wait_until(pilot, gate.reached.is_set)
        await pilot.press("escape")
        await wait_until(pilot, lambda: server.service._jobs and next(
            iter(server.service._jobs)).cancel_event.is_set())
        gate.release()
        await wait_until(pilot, lambda: not app.running)
        assert app.conv.messages == [] and composer.pastes[0].text == text  # the prompt is back
        await wait_until(pilot, lambda: not server.service._jobs)
        composer.clear()
        await pilot.pause()
        await send(pilot, "house")
        assert app.conv.messages[1].content == fresh_answer(str(demo_path), "house", MAX_NEW)
    done = [e for e in seen if isinstance(e, RequestDone)]
    assert done[0].cancelled and not done[-1].cancelled


@async_test
async def test_a_server_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    app = remote_app(tmp_path, f"http://127.0.0.1:{port}")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: bool(app.error_line))
    assert app.error_line.startswith(f"cannot reach http://127.0.0.1:{port}")
    assert "strata serve" in app.error_line and app.return_code == 2


@async_test
async def test_a_wrong_key_says_how_to_give_one(tmp_path: Path) -> None:
    service = Service(ServerConfig(model_id="demo", port=0, api_key="s3cret"), EventBus())
    server = ServerThread(service, "127.0.0.1", 0).start()  # the key is checked first
    try:
        app = remote_app(tmp_path, server.url, api_key="guess")
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: bool(app.error_line))
    finally:
        server.stop()
    assert "the API key is wrong" in app.error_line and "--api-key" in app.error_line


def test_connect_wants_a_url() -> None:
    parser = OneLineParser(prog="strata chat")
    add_chat_args(parser)
    config = chat_config(parser.parse_args(["--connect", "http://127.0.0.1:8080/", "--api-key",
                                            "k", "--max-new", "9"]))
    assert (config.connect, config.api_key, config.max_new) == ("http://127.0.0.1:8080", "k", 9)
    with pytest.raises(StrataError, match="give the server's URL"):
        chat_config(parser.parse_args(["--connect", "127.0.0.1:8080"]))


@async_test
async def test_the_paste_chip_asks_the_server(tmp_path: Path, server: Running) -> None:
    """Connected, the composer's question goes to the server (POST /v1/forecast): the chip
    says the server's own verdict on the message."""
    from app.widgets.prompt_input import PromptInput, expand
    from engine.server.worker import API_CONVERSATION

    app = remote_app(tmp_path, server.url)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        composer = app.query_one(Composer)
        app.post_message(Paste(sample_paste(30)))
        await wait_until(pilot, lambda: composer.verdict is not None and bool(composer.pastes)
                         and composer.pastes[0].n_tokens is not None)
        text = expand(app.query_one(PromptInput).text, composer.pastes)
        here = server.loop.preview(Conversation(id=API_CONVERSATION), text)
        assert composer.verdict.line() == here.line()
        assert composer.pastes[0].n_tokens == server.loop.count_tokens(sample_paste(30))
        assert here.line() in str(composer.query_one("#chips").render())
