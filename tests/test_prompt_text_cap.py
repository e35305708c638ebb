"""Text that cannot fit the context is refused before the chat template or the tokenizer
reads it (a 50 MB message in a conversation used to cost seconds and gigabytes to send)."""

from __future__ import annotations

import pytest

from engine.config import EngineOptions
from engine.errors import StrataError
from engine.request.conversation import PROMPT_BYTES_PER_TOKEN, Conversation, check_text_fits
from engine.runtime.serve import ServeLoop

CTX = 256
LIMIT = PROMPT_BYTES_PER_TOKEN * CTX


def test_the_cap_counts_utf8_bytes_and_names_the_context() -> None:
    check_text_fits(["x" * LIMIT], CTX)
    check_text_fits(["x" * (LIMIT // 2), "y" * (LIMIT // 2)], CTX)
    with pytest.raises(StrataError, match=f"over {LIMIT:,} bytes .* --ctx {CTX}"):
        check_text_fits(["x" * (LIMIT // 2), "y" * (LIMIT // 2 + 1)], CTX)
    with pytest.raises(StrataError):  # 3 bytes a character in UTF-8
        check_text_fits(["\u20ac" * (LIMIT // 3 + 1)], CTX)
    with pytest.raises(StrataError):  # a lone surrogate is counted, not an encoding error
        check_text_fits(["\ud800" * (LIMIT // 3 + 1)], CTX)
    with pytest.raises(StrataError):
        check_text_fits(["z" * 50_000_000], CTX)


def test_a_huge_message_in_history_is_refused_and_the_engine_goes_on() -> None:
    loop = ServeLoop.create(EngineOptions(model="demo", device="sim", ctx=CTX))
    try:
        conv = Conversation()
        conv.add("user", "w" * 5_000_000)  # restored from the history, say
        conv.add("assistant", "ok")
        with pytest.raises(StrataError, match="more than the context can hold"):
            loop.chat(conv, "house", max_new=2)
        assert len(conv.as_dicts()) == 2  # nothing lost, nothing added
        with pytest.raises(StrataError, match="more than the context can hold"):
            loop.preview(conv, "house")
        with pytest.raises(StrataError, match="more than the context can hold"):
            loop.count_tokens("p" * (LIMIT + 1))
        assert loop.count_tokens("house") > 0
        fresh = Conversation()
        assert loop.chat(fresh, "house", max_new=2).text is not None
    finally:
        loop.close()
