"""Stop strings: the streamed text never shows one, and the answer ends before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineOptions
from engine.request.conversation import Conversation
from engine.request.stops import StopStrings
from engine.runtime.serve import ServeLoop


def stream(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    s = StopStrings(stops)
    out = "".join(s.push(p) for p in pieces)
    return out + s.flush(), s.hit


@pytest.mark.parametrize(
    ("pieces", "text", "hit"),
    [
        (["a b", "c ST", "OP d"], "a bc ", "STOP"),  # across pieces
        (["STOP"], "", "STOP"),
        (["xx S", "T", "x"], "xx STx", None),  # a held tail that was no stop after all
        (["end S"], "end S", None),  # the generation ended while a tail was held
        (["one ", "END two STOP"], "one ", "END"),  # the earliest stop string wins
    ],
)
def test_stop_strings_cut_streamed_text(pieces: list[str], text: str, hit: str | None) -> None:
    assert stream(["STOP", "END"], pieces) == (text, hit)


def test_what_is_shown_never_holds_a_stop_string() -> None:
    s = StopStrings(["\n\n"])
    assert s.push("a\n") == "a"  # the newline may start the stop string
    assert s.push("b") == "\nb"
    assert s.push("\n") == "" and s.push("\nc") == "" and s.hit == "\n\n"
    assert s.push("more") == "" and s.flush() == ""


def test_no_stop_strings_pass_text_through() -> None:
    s = StopStrings(["", ""])  # empty ones are none
    assert s.push("abc") == "abc" and s.flush() == "" and s.hit is None


def test_the_serve_loop_ends_the_answer_before_a_stop_string(demo_path: Path) -> None:
    loop = ServeLoop.create(EngineOptions(model=str(demo_path), ctx=512))
    full = loop.chat(Conversation(), "What does 'water' mean?", max_new=24)
    assert full.finish_reason == "length" and "compound" in full.text
    shown: list[str] = []
    conv = Conversation()
    cut = loop.chat(conv, "What does 'water' mean?", max_new=24, on_text=shown.append,
                    stop=["compound"])
    assert cut.text == full.text[: full.text.index("compound")] == "".join(shown)
    assert cut.finish_reason == "stop" and conv.messages[-1].content == cut.text
    done = loop.chat(Conversation(), "house", max_new=64)
    assert done.finish_reason == "stop" and done.timing.generated < 64  # its end token
