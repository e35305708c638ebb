"""EventLog: the engine's trace lines and the loan steps, as the CLI would print them."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from app.engine_link import EngineLink
from app.widgets.fmt import fmt_bytes, fmt_ms
from engine.events import (
    ErrorEvent,
    Event,
    FlagsChanged,
    FlagsRefused,
    LoanStep,
    Ready,
    TraceLine,
)


def event_line(event: Event) -> Text | None:
    """The log line for one event, or None for events the log does not show."""
    if isinstance(event, TraceLine):
        return Text(event.text)
    if isinstance(event, LoanStep):
        size = f" {fmt_bytes(event.n_bytes)}" if event.n_bytes else ""
        style = "red" if event.step in ("failed", "cancelled") else "#d7875f"
        return Text(f"loan {event.step}: {event.detail}{size} in {fmt_ms(event.ms)}", style=style)
    if isinstance(event, FlagsChanged):
        shown = " ".join(f"{k.removeprefix('STRATA_PREFILL_')}={v}" for k, v in event.flags)
        return Text(f"flags accepted (next message): {shown}", style="green")
    if isinstance(event, FlagsRefused):
        return Text("flags refused: " + "; ".join(event.violations), style="bold red")
    if isinstance(event, ErrorEvent):
        return Text(f"error: {event.message}", style="bold red")
    if isinstance(event, Ready):
        return Text(f"ready: {event.summary} on {event.device}", style="dim")
    return None


class EventLog(RichLog):
    """A scrolling log of `event_line` for every engine event that has one."""

    DEFAULT_CSS = """
    EventLog {
        height: 1fr;
        min-height: 5;
        border: none;
        border-top: solid $primary 40%;
        border-title-color: $text-primary;
        background: $surface;
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_lines=1000, wrap=True, markup=False, **kwargs)  # type: ignore[arg-type]

    def on_mount(self) -> None:
        self.border_title = "Event log"

    def on_engine_link_events(self, message: EngineLink.Events) -> None:
        for event in message.events:
            line = event_line(event)
            if line is not None:
                self.write(line)
