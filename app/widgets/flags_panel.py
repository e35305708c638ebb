"""FlagsPanel: the six loan flags, the repeat threshold, spec T and the prefill mode.

Every change is posted as `FlagsPanel.Requested`; the app asks the engine and answers with
`accepted` (the panel shows "applies from the next message") or `refused` (the panel shows
the reasons and puts its controls back to the flags in force). While the threshold is being
typed (before Enter) the panel posts `FlagsPanel.WhatIf`; the app answers both with the
forecast of a message under the changed flags beside the flags in force (`forecast`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Input, Label, Select, Static, Switch

from app.widgets.toggle import Toggle
from engine.config import (
    AUTO,
    ENV_NAMES,
    REPEAT_MIN_DEFAULT,
    EngineOptions,
    LoanFlags,
    parse_threshold,
)
from engine.errors import FlagError

SWITCHES = ("elastic_loan", "mtp_loan", "head_loan", "retain_startup_chunk", "repeat_loan")
SPEC_CHOICES = (0, 2, 3, 4, 5, 6, 7, 8)
PREFILL_CHOICES: tuple[int | str, ...] = ("auto", 256, 512, 1024, 2048)


def short_name(flag: str) -> str:
    return ENV_NAMES[flag].removeprefix("STRATA_PREFILL_")


class FlagsPanel(Widget):
    """Controls for LoanFlags and the two runtime options (spec T, prefill)."""

    DEFAULT_CSS = """
    FlagsPanel {
        height: auto;
        border: none;
        border-top: solid $primary 40%;
        border-title-color: $text-primary;
        padding: 0 1;
        & Horizontal { height: 1; }
        & Toggle { margin-right: 1; }
        & Label { height: 1; }
        & Input { width: 12; height: 1; border: none; padding: 0 1; }
        & Select { width: 14; }
        & #flags-status { height: auto; margin-top: 1; }
        & #flags-forecast { height: auto; }
        & .-refused { color: $error; }
        & .-accepted { color: $success; }
    }
    """

    @dataclass
    class Requested(Message):
        """The user asked for these flags and options."""

        flags: LoanFlags
        options: EngineOptions

    @dataclass
    class WhatIf(Message):
        """The user is changing a flag (not applied yet): what would these flags do?"""

        flags: LoanFlags
        options: EngineOptions

    flags: reactive[LoanFlags] = reactive(LoanFlags, init=False)
    options: reactive[EngineOptions] = reactive(EngineOptions, init=False)
    status: reactive[Text] = reactive(Text(""), init=False)
    forecast: reactive[Text] = reactive(Text(""), init=False)  # the what-if, from the app

    def compose(self) -> ComposeResult:
        for name in SWITCHES:
            with Horizontal():
                yield Toggle(value=getattr(self.flags, name), id=name, animate=False)
                yield Label(short_name(name))
        with Horizontal():
            yield Input(
                self.flags.threshold_text,
                restrict=r"[0-9]*|[aA][uU]?[tT]?[oO]?",  # a count, or auto as it is typed
                id="repeat_min_tokens",
                compact=True,
            )
            yield Label(short_name("repeat_min_tokens"))
        with Horizontal():
            yield Label("spec T ")
            yield Select(
                [(str(t) if t else "0 (off)", t) for t in SPEC_CHOICES],
                value=self.options.spec,
                allow_blank=False,
                compact=True,
                id="spec",
            )
            yield Label(" prefill ")
            yield Select(
                [(str(p), p) for p in PREFILL_CHOICES],
                value=self.options.prefill if self.options.prefill in PREFILL_CHOICES else "auto",
                allow_blank=False,
                compact=True,
                id="prefill",
            )
        yield Static(id="options-line")
        yield Static(id="flags-status")
        yield Static(id="flags-forecast")

    def on_mount(self) -> None:
        self.border_title = "Loan flags"
        self.query_one("#flags-forecast", Static).display = False
        self.call_later(self._sync)  # `is_mounted` turns true once this handler returns

    def focus_first(self) -> None:
        """Focus the first switch without scrolling to it (the caller scrolls the panel to
        the top at once: Textual's own focus scroll is animated, and it ended where the two
        met, a fraction of a line apart from one run to the next)."""
        self.query_one(f"#{SWITCHES[0]}", Switch).focus(scroll_visible=False)

    # -- the app's answers -------------------------------------------------------------------
    def show(self, flags: LoanFlags, options: EngineOptions) -> None:
        """Set the flags and options in force (at start, or after an accepted change)."""
        self.options = options
        self.flags = flags

    def accepted(self, flags: LoanFlags, options: EngineOptions) -> None:
        # the master switch turned off takes its sub-options with it (LoanFlags.with_changes)
        with_master = [short_name(n) for n in self.flags.sub_options_on()
                       if self.flags.elastic_loan and not flags.elastic_loan
                       and not getattr(flags, n)]
        self.show(flags, options)
        message = Text("accepted: applies from the next message", style="green")
        if with_master:
            message.append(f"\noff with the master switch: {', '.join(with_master)}",
                           style="green")
        for warning in flags.warnings_for(options):
            message.append(f"\n{warning}", style="yellow")
        self.status = message

    def refused(self, violations: list[str]) -> None:
        self.status = Text("refused:\n" + "\n".join(f"· {v}" for v in violations), style="red")
        self.forecast = Text("")
        self._sync()  # put every control back to the flags in force

    # -- watchers ----------------------------------------------------------------------------
    def watch_flags(self) -> None:
        self._sync()

    def watch_options(self) -> None:
        self._sync()

    def watch_status(self, status: Text) -> None:
        if self.is_mounted:
            self.query_one("#flags-status", Static).update(status)

    def watch_forecast(self, forecast: Text) -> None:
        if self.is_mounted:
            box = self.query_one("#flags-forecast", Static)
            box.display = bool(forecast.plain)
            box.update(forecast)

    def _sync(self) -> None:
        if not self.is_mounted:
            return
        with self.prevent(Switch.Changed, Select.Changed, Input.Changed):
            for name in SWITCHES:
                self.query_one(f"#{name}", Switch).value = getattr(self.flags, name)
            self.query_one("#repeat_min_tokens", Input).value = self.flags.threshold_text
            self.query_one("#spec", Select).value = self.options.spec
            prefill = self.options.prefill
            self.query_one("#prefill", Select).value = (
                prefill if prefill in PREFILL_CHOICES else "auto"
            )
        o = self.options
        self.query_one("#options-line", Static).update(
            Text(
                f"--serve {'on' if o.serve else 'off'}  --vram-elastic "
                f"{'on' if o.vram_elastic else 'off'}  --mtp {'on' if o.mtp else 'off'}",
                style="dim",
            )
        )

    # -- user changes ------------------------------------------------------------------------
    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        name = event.switch.id or ""
        if name in SWITCHES and event.value != getattr(self.flags, name):
            self.post_message(
                self.Requested(self.flags.with_changes(**{name: event.value}), self.options)
            )

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            flags = threshold_flags(self.flags, event.value)
        except FlagError as exc:  # not a count, or one past any prompt
            self.refused(exc.violations)
            return
        if flags != self.flags or flags.warnings:  # a clamped count says so when accepted
            self.post_message(self.Requested(flags, self.options))

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        try:
            flags = threshold_flags(self.flags, event.value)
        except FlagError:  # half typed: nothing to forecast yet
            return
        if flags == self.flags:
            self.forecast = Text("")
        else:
            self.post_message(self.WhatIf(flags, self.options))

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        key = event.select.id
        if key == "spec" and event.value != self.options.spec:
            self.post_message(
                self.Requested(self.flags, self.options.with_changes(spec=event.value))
            )
        elif key == "prefill" and event.value != self.options.prefill:
            self.post_message(
                self.Requested(self.flags, self.options.with_changes(prefill=event.value))
            )


def threshold_flags(flags: LoanFlags, text: str) -> LoanFlags:
    """`flags` with STRATA_PREFILL_REPEAT_MIN_TOKENS as typed, read as the variable is
    (`parse_threshold`: 'auto', a count clamped to >= 256, empty for the default; FlagError
    naming the value otherwise)."""
    value = parse_threshold(text)
    if value == AUTO:
        return flags.with_changes(repeat_auto=True)
    n = REPEAT_MIN_DEFAULT if value is None else int(value)  # empty: as if the variable were unset
    return flags.with_changes(repeat_min_tokens=n, repeat_auto=False)
