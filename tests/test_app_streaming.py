"""Decoding at the engine's speed: the UI thread's cost is a cost per frame, not per token.

Tokens reach the chat log in batches at the drain's frame rate, the dashboard's events wait
while an answer streams, finished Markdown blocks are appended (never parsed again), a long
code block is parsed once its fence closes, and a streamed answer is not drawn again when
the engine's reply is what streamed.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from markdown_it import MarkdownIt
from test_app_flows import SIZE, async_test, make_app, reference_reply
from textual.app import App, ComposeResult
from textual.widgets import Markdown

from app.bench_decode import Sample, table
from app.config import ChatConfig
from app.engine_link import VIEWS_WHILE_STREAMING_S, Drain, coalesce
from app.scenes import wait_ready, wait_until
from app.widgets.answer_stream import BlockCutter, open_block_start
from app.widgets.chat_log import ChatLog, MessageView, printable
from engine.config import EngineOptions, LoanFlags
from engine.trace.events import CacheChanged, LedgerChanged, RequestDone, Token, TraceLine

PIECES = ["```", "~~~", "````", "py", "x = 1", "\n", "\n\n", "# Title", "- item", "1. one",
          "text", " ", "`", "> quote", "    indented", "| a | b |", "|---|---|", "**b**"]


def test_block_cutter_agrees_with_parsing_the_open_block_on_every_write() -> None:
    """The fence shortcut gives the cut a parse of the open block gives (the reference: parse
    whenever a line began since the last write), whatever the text and however it is split."""
    parser = MarkdownIt("gfm-like")
    rng = random.Random(28)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 60)))
        cutter, tail, new_line = BlockCutter(), "", True
        cuts = sorted(rng.sample(range(1, len(text) + 1), min(len(text), rng.randint(1, 12))))
        start = 0
        for end in [*cuts, len(text)]:
            piece = text[start:end]
            start = end
            if not piece:
                continue
            pending = tail + piece
            expected = open_block_start(pending, parser) if "\n" in piece or new_line else 0
            new_line = not pending[pending.rfind("\n") + 1 :].strip()
            got = cutter.cut(tail, piece)
            assert got == expected, (text, pending, got, expected)
            tail = pending[got:]


def test_a_long_code_block_is_parsed_when_its_fence_closes_not_on_every_line() -> None:
    cutter, tail = BlockCutter(), ""
    pieces = ["Intro.\n\n", "```python\n", *(f"x{i} = {i}\n" for i in range(3000)), "```\n",
              "After."]
    cut_at = []
    for piece in pieces:
        pending = tail + piece
        cut = cutter.cut(tail, piece)
        if cut:
            cut_at.append(pending[cut:][:12])
        tail = pending[cut:]
    assert cut_at == ["```python\n", "After."]
    assert cutter.parses <= 4, cutter.parses  # not one a line: 3,000 lines parsed 3,000 times


def test_coalesce_joins_a_long_run_of_tokens_into_one() -> None:
    tokens = [Token(f"t{i} ", t=float(i)) for i in range(10_000)]
    out = coalesce([*tokens, TraceLine("strata lend: x"), Token("end")])
    assert [type(e) for e in out] == [Token, TraceLine, Token]
    first = out[0]
    assert isinstance(first, Token)
    assert first.text == "".join(t.text for t in tokens) and first.t == 9_999.0


def test_the_drain_sends_text_in_frames_and_the_dashboard_now_and_then_while_streaming() -> None:
    drain = Drain(frame_s=0.1, views_s=2.0)
    ledger = LedgerChanged(1 << 30, 1 << 21, (), 1 << 30, ())
    cache = CacheChanged(b"\x01\x02", (1, 2), 1)
    trace = TraceLine("strata lend: decoding plain")
    # before any text: everything goes at once
    assert drain.tick([trace], now=0.0) == (trace,)
    assert not drain.streaming
    # the first text waits until it is a frame old, and what came with it (the loan's
    # snapshots) waits for the dashboard's turn
    assert drain.tick([ledger, Token("Hel", t=0.95), Token("lo", t=0.97)], now=1.0) == ()
    assert drain.streaming
    out = drain.tick([Token(",", t=1.06)], now=1.06)
    assert [e.text for e in out if isinstance(e, Token)] == ["Hello,"]
    assert not any(isinstance(e, LedgerChanged) for e in out)
    assert drain.tick([cache, trace], now=1.5) == ()  # nothing for the chat: no post
    out = drain.tick([Token(" world", t=2.9)], now=2.9)
    assert [type(e) for e in out] == [Token]
    # views_s after the answer began: the held events go, the newest snapshot of each kind
    out = drain.tick([Token("!", t=3.0)], now=3.0)
    assert set(map(type, out)) == {LedgerChanged, CacheChanged, TraceLine, Token}
    assert drain.tick([ledger], now=3.5) == ()
    # the answer ends: RequestDone and whatever waited go at once, and the stream is over
    done = RequestDone(generated=5)
    out = drain.tick([Token("?", t=3.55), done], now=3.6)
    assert done in out and ledger in out and not drain.streaming
    assert drain.tick([ledger], now=3.7) == (ledger,)


def test_an_answer_decoded_within_a_frame_is_drawn_once_when_it_is_done() -> None:
    """On a GPU a short answer takes less than a frame: the UI thread does nothing while the
    engine decodes it (its work would hold the GIL the engine thread waits for)."""
    drain = Drain(frame_s=1 / 15)
    tokens = [Token(f"w{i} ", t=10.0 + i * 0.0016) for i in range(21)]  # 618 tok/s
    assert drain.tick(tokens[:5], now=10.01) == ()
    done = RequestDone(generated=21)
    out = drain.tick([*tokens[5:], done], now=10.07)
    assert [type(e) for e in out] == [RequestDone, Token]
    assert out[1].text == "".join(t.text for t in tokens)  # type: ignore[union-attr]


def test_the_drain_holds_frames_while_the_ui_thread_is_over_its_budget() -> None:
    """Each frame costs the UI thread CPU time the engine thread waits for under the GIL: past
    `budget` of the time since the answer began (plus `burst_s`), the text waits for a later
    tick; the answer's end takes it all the same."""
    drain = Drain(frame_s=0.1, views_s=2.0, budget=0.05, burst_s=0.01, max_hold_s=10.0)
    assert drain.tick([Token("a", t=0.0)], now=0.0, cpu=10.0) == ()
    out = drain.tick([Token("b", t=0.1)], now=0.1, cpu=10.0)  # idle so far: the frame goes
    assert [e.text for e in out] == ["ab"]  # type: ignore[union-attr]
    # that frame (and a layout) cost 40 ms: over 5% of 0.2 s + 10 ms, the text waits
    assert drain.tick([Token("c", t=0.2)], now=0.2, cpu=10.04) == ()
    assert drain.tick([Token("d", t=0.3)], now=0.3, cpu=10.04) == ()
    # 0.6 s in, 5% of it is 30 ms + 10 ms: within the budget again, what waited goes
    out = drain.tick([Token("e", t=0.6)], now=0.6, cpu=10.04)
    assert [e.text for e in out] == ["cde"]  # type: ignore[union-attr]
    assert drain.tick([Token("f", t=0.7)], now=0.7, cpu=10.2) == ()
    done = RequestDone(generated=6)
    out = drain.tick([done], now=0.8, cpu=10.2)
    assert done in out and any(isinstance(e, Token) and e.text == "f" for e in out)
    assert not drain.streaming
    # the next answer's budget counts from its own first token
    assert drain.tick([Token("g", t=5.0)], now=5.0, cpu=10.2) == ()
    assert drain.tick([Token("h", t=5.1)], now=5.1, cpu=10.2) != ()


def test_over_its_budget_the_drain_still_sends_the_text_now_and_then() -> None:
    """The budget counts all the UI thread's work (a user scrolling while the answer streams):
    the text waits at most `max_hold_s`, however busy the UI thread is."""
    drain = Drain(frame_s=0.1, budget=0.03, burst_s=0.01, max_hold_s=0.5)
    assert drain.tick([Token("a", t=0.0)], now=0.0, cpu=0.0) == ()
    sent = []
    for i in range(1, 31):  # the UI thread busy half of every tick
        now = i * 0.1
        out = drain.tick([Token("x", t=now)], now=now, cpu=now / 2)
        if out:
            sent.append(round(now, 1))
    assert sent == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0], sent


def test_a_finished_request_takes_everything_the_drain_held() -> None:
    drain = Drain(views_s=VIEWS_WHILE_STREAMING_S)
    a = Token("a", t=0.0)
    assert drain.tick([a], now=0.0) == ()  # not a frame old yet
    trace = TraceLine("strata lend: lent")
    assert drain.tick([trace], now=0.01) == ()
    b = Token("b")
    assert drain.take([b]) == (trace, Token("ab", t=b.t))
    assert not drain.streaming


class ChatHost(App[None]):
    def compose(self) -> ComposeResult:
        yield ChatLog()


ANSWER = (
    "# Lending the tail\n\nThe expert cache lends its **tail** to the prompt path.\n\n"
    "- the slots past the line\n- the staging ring\n\n"
    "```python\n" + "".join(f"slot_{i} = lend({i})\n" for i in range(60)) + "```\n\n"
    "> a quote, then a table:\n\n| part | bytes |\n|---|---:|\n| ring | 4 MiB |\n\n"
    "And a last paragraph, long enough to wrap at this width and then some more words."
)


def test_a_streamed_answer_is_appended_block_by_block_and_not_drawn_again() -> None:
    """Streamed in small pieces (a frame's worth each), the answer ends holding exactly the
    reply; its blocks went into the Markdown one by one and the body was never drawn whole."""

    async def run() -> tuple[str, int, int, list[str], list[str]]:
        app = ChatHost()
        async with app.run_test(size=(80, 24)) as pilot:
            chat = app.query_one(ChatLog)
            await chat.begin_exchange("How does the loan work?")
            rng = random.Random(3)
            i = 0
            while i < len(ANSWER):
                n = rng.randint(10, 90)
                await chat.append(ANSWER[i : i + n])
                i += n
                await pilot.pause()
            stream = chat._stream
            assert stream is not None
            await chat.finish(ANSWER)
            await pilot.pause()
            answer = chat.query(MessageView).last()
            markdown = answer.query_one(Markdown)
            streamed_blocks = [type(b).__name__ for b in markdown.children]
            fresh = MessageView("assistant", ANSWER)
            await chat.mount(fresh)
            await pilot.pause()
            drawn_blocks = [type(b).__name__ for b in fresh.query_one(Markdown).children]
            return (markdown.source, answer.full_renders, stream.blocks_appended,
                    streamed_blocks, drawn_blocks)

    source, full_renders, appended, streamed_blocks, drawn_blocks = asyncio.run(run())
    assert source == printable(ANSWER)
    assert full_renders == 0
    assert appended >= 5  # 7 blocks: two may finish in one append
    assert streamed_blocks == drawn_blocks  # the same blocks as the whole text drawn at once


def test_an_answer_that_differs_from_what_streamed_is_drawn_once_from_the_reply() -> None:
    async def run() -> tuple[str, int]:
        app = ChatHost()
        async with app.run_test(size=(80, 24)) as pilot:
            chat = app.query_one(ChatLog)
            await chat.begin_exchange("hi")
            await chat.append("Hello there")
            await pilot.pause()
            await chat.finish("Hello there, friend.")
            await pilot.pause()
            answer = chat.query(MessageView).last()
            return answer.query_one(Markdown).source, answer.full_renders

    assert asyncio.run(run()) == ("Hello there, friend.", 1)


@async_test
async def test_the_app_streams_the_engines_reply_whole_and_draws_it_once(tmp_path: Path) -> None:
    """The real engine (the tiny preset): the answer shown is the engine's reply text, stored
    as such, and it streamed in by appends (no full render at the end)."""
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press(*"hello")
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.running and len(app.conv.messages) == 2)
        reply = app.conv.messages[1].content
        answer = app.query(MessageView).last()
        assert reply == reference_reply(["hello"])
        assert answer.query_one(Markdown).source == printable(reply)
        assert answer.full_renders == 0
        assert not app.link._drain.streaming  # the request is over: nothing is held


def test_bench_decode_reports_the_ui_threads_cpu_a_token() -> None:
    config = ChatConfig(EngineOptions(model="demo"), LoanFlags(), max_new=256)
    cli = [Sample(256, 1000.0), Sample(256, 1100.0)]
    app = [Sample(256, 1050.0, ui_cpu_ms=52.0, ui_wall_ms=1040.0),
           Sample(256, 1020.0, ui_cpu_ms=40.0, ui_wall_ms=1010.0)]
    text = table(config, "hi", cli, app)
    row = next(line for line in text.splitlines() if line.startswith("| app"))
    assert "4.5% (4.0–5.0%)" in row  # the share of the decode's wall time
    assert "0.180 ms (0.156–0.203)" in row  # UI CPU ms over generated tokens
    assert "ended an answer" not in text
    short = table(config, "hi", [Sample(21, 40.0)], [Sample(21, 42.0, 1.0, 40.0)])
    assert "the model ended an answer after 21 tokens (of --max-new 256)" in short
