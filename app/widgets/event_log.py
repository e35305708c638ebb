"""EventLog: the engine's trace lines and the loan steps, as the CLI would print them."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual import events
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import RichLog

from app.engine_link import EngineLink
from engine.trace.events import (
    Event,
    FlagsChanged,
    FlagsRefused,
    LoanStep,
    Ready,
    TraceLine,
)

MAX_LINES = 1000
LOAN_PREFIX = "strata loan: "  # the engine prints each loan step as a trace line too
LOAN_STYLE = "#d7875f"
# trace lines that repeat a LoanStep: the loan's own ("strata loan: released ...") and the
# prompt path's lend and refill ("strata trace: lent ...", published before their step)
TWIN_PREFIXES = (LOAN_PREFIX, "strata trace: lent ", "strata trace: refilled ")
MAX_TWINS = 64  # a line whose twin never comes is forgotten after this many others


def loan_step_line(event: LoanStep) -> str:
    """A loan step as the CLI prints it: the prompt path's steps are whole trace lines
    ('strata trace: refilled ...'), the transaction's go after 'strata loan: '."""
    return event.detail if event.detail.startswith("strata ") else LOAN_PREFIX + event.detail


def event_line(event: Event) -> Text | None:
    """The log line for one event, or None for events the log does not show."""
    if isinstance(event, TraceLine):
        return Text(event.text, style=LOAN_STYLE if event.text.startswith(TWIN_PREFIXES) else "")
    if isinstance(event, LoanStep):
        style = "red" if event.step in ("failed", "cancelled") else LOAN_STYLE
        return Text(loan_step_line(event), style=style)
    if isinstance(event, FlagsChanged):
        shown = " ".join(f"{k.removeprefix('STRATA_PREFILL_')}={v}" for k, v in event.flags)
        line = Text(f"flags accepted (next message): {shown}", style="green")
        for w in event.warnings:
            line.append(f"\nwarning: {w}", style="yellow")
        return line
    if isinstance(event, FlagsRefused):
        return Text("flags refused: " + "; ".join(event.violations), style="bold red")
    if isinstance(event, Ready):
        return Text(f"ready: {event.summary} on {event.device}", style="dim")
    return None


class EventLog(RichLog):
    """A scrolling log of `event_line` for every engine event that has one, wrapped to the
    pane's width (and wrapped again when the pane changes width). A loan step is shown once:
    of it and its trace line, which repeats it, whichever comes first."""

    DEFAULT_CSS = """
    EventLog {
        height: 1fr;
        min-height: 5;
        border: none;
        border-top: solid $primary 40%;
        border-title-color: $text-primary;
        background: $surface;
        overflow-x: hidden;
        scrollbar-gutter: stable;
    }
    """

    # A line written grows the virtual height, and Textual's reactive asks for a layout for it:
    # a reflow of the whole screen, tens of ms the engine thread waits for under the GIL while
    # it decodes. The log's box does not change with its lines: only its scrollbar needs the
    # new height, and a layout is due only when the scrollbar appears (`show_vertical_scrollbar`
    # asks for one itself).
    virtual_size = Reactive(Size(0, 0), layout=False)

    def watch_virtual_size(self, size: Size) -> None:
        self._scroll_update(size)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_lines=MAX_LINES, min_width=1, wrap=True, markup=False, **kwargs)  # type: ignore[arg-type]
        self._entries: deque[Text] = deque(maxlen=MAX_LINES)
        # lines shown whose twin (a loan step and its trace line, in either order) is to come
        self._twins: deque[str] = deque(maxlen=MAX_TWINS)
        self._wrap_width = 0

    def on_mount(self) -> None:
        self.border_title = "Event log"

    def on_engine_link_events(self, message: EngineLink.Events) -> None:
        for event in message.events:
            line = event_line(event)
            if line is None:
                continue
            if isinstance(event, LoanStep) or (
                    isinstance(event, TraceLine) and event.text.startswith(TWIN_PREFIXES)):
                if line.plain in self._twins:  # its twin is shown: one fact, one line
                    self._twins.remove(line.plain)
                    continue
                self._twins.append(line.plain)
            self._entries.append(line)
            # at the width laid out, not RichLog's default (the visible region's): scrolled
            # out of the dashboard's view, or hidden, that is 0 and a line wrapped at one cell
            self.write(line, width=self._wrap_width or None)

    def on_resize(self, event: events.Resize) -> None:
        # from the laid-out size: the visible region is empty while scrolled out of view
        width = event.size.width - self.styles.gutter.width - self.scrollbar_gutter.width
        if width == self._wrap_width or width <= 0:
            return
        self._wrap_width = width
        # lines written at the old width (or not written while hidden): lay them out again;
        # before the first size they queue, and RichLog's own handler writes them next
        self.clear()
        for line in self._entries:
            self.write(line, width=width)
