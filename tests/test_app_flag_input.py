"""The flags panel's threshold input: a negative value is refused in the panel, as the same
value in STRATA_PREFILL_REPEAT_MIN_TOKENS is refused on the command line."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult
from textual.widgets import Input

from app.widgets.flags_panel import FlagsPanel


class Host(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.requested: list[FlagsPanel.Requested] = []

    def compose(self) -> ComposeResult:
        yield FlagsPanel()

    def on_flags_panel_requested(self, message: FlagsPanel.Requested) -> None:
        self.requested.append(message)


def submit(value: str) -> tuple[str, list[FlagsPanel.Requested]]:
    async def run() -> tuple[str, list[FlagsPanel.Requested]]:
        app = Host()
        async with app.run_test(size=(80, 30)) as pilot:
            await pilot.pause()
            box = app.query_one("#repeat_min_tokens", Input)
            box.value = value
            box.post_message(Input.Submitted(box, value))  # what Enter sends
            await pilot.pause()
            await pilot.pause()
            return str(app.query_one(FlagsPanel).status), app.requested

    return asyncio.run(run())


def test_a_negative_threshold_is_refused_in_the_panel() -> None:
    status, requested = submit("-5")
    assert not requested
    assert "refused" in status and "STRATA_PREFILL_REPEAT_MIN_TOKENS=-5 is negative" in status


def test_a_positive_threshold_is_requested() -> None:
    status, requested = submit("2048")
    assert [m.flags.repeat_min_tokens for m in requested] == [2048] and "refused" not in status
