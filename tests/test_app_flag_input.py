"""The flags panel's threshold input reads a value as STRATA_PREFILL_REPEAT_MIN_TOKENS is read:
a negative one is clamped to 256 (with the warning), one past any prompt or not a count is
refused, an empty one is the default."""

from __future__ import annotations

import asyncio

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Input

from app.widgets.flags_panel import FlagsPanel
from engine.config import EngineOptions, LoanFlags


class Host(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.requested: list[FlagsPanel.Requested] = []

    def compose(self) -> ComposeResult:
        yield FlagsPanel()

    def on_flags_panel_requested(self, message: FlagsPanel.Requested) -> None:
        self.requested.append(message)


def submit(value: str, flags: LoanFlags | None = None) -> tuple[str, list[FlagsPanel.Requested]]:
    async def run() -> tuple[str, list[FlagsPanel.Requested]]:
        app = Host()
        async with app.run_test(size=(80, 30)) as pilot:
            await pilot.pause()
            if flags is not None:
                app.query_one(FlagsPanel).show(flags, EngineOptions())
                await pilot.pause()
            box = app.query_one("#repeat_min_tokens", Input)
            box.value = value
            box.post_message(Input.Submitted(box, value))  # what Enter sends
            await pilot.pause()
            await pilot.pause()
            return str(app.query_one(FlagsPanel).status), app.requested

    return asyncio.run(run())


def test_a_negative_threshold_is_clamped_with_the_warning() -> None:
    _status, requested = submit("-5")
    (message,) = requested
    assert message.flags.repeat_min_tokens == 256
    assert message.flags.warnings == (("STRATA_PREFILL_REPEAT_MIN_TOKENS=-5 is below the minimum "
                                      "of 256 tokens; clamped to 256"),)


@pytest.mark.parametrize(("value", "why"), [("1" + "0" * 30, "is larger than any prompt"),
                                            ("1_000", "is not an integer"),
                                            ("\u0661\u0660", "is not an integer")])
def test_a_threshold_the_variable_refuses_is_refused_in_the_panel(value: str, why: str) -> None:
    status, requested = submit(value)
    assert not requested and "refused" in status and why in status


def test_an_empty_threshold_is_the_default() -> None:
    status, requested = submit(" ", LoanFlags.make(repeat_min_tokens=4096))
    assert [m.flags.repeat_min_tokens for m in requested] == [1024] and "refused" not in status


def test_a_positive_threshold_is_requested() -> None:
    status, requested = submit("2048")
    assert [m.flags.repeat_min_tokens for m in requested] == [2048] and "refused" not in status
