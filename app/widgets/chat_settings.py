"""The conversation settings dialog: a conversation's system prompt and sampling.

`SamplingForm` holds the fields and checks them with the engine's own rules (`SamplingParams`,
`Sampling`, the prompt-text cap of `--ctx`), showing every refusal at once under the fields;
`ChatSettingsScreen` is the modal dialog around it, dismissed with a `ChatSettings` (or None
when closed without applying).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Vertical
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widgets import Checkbox, Input, Label, TextArea

from engine.cli.options import integer, number
from engine.errors import FlagError, StrataError
from engine.request.conversation import Sampling, check_text_fits
from engine.request.sampler import SamplingParams

# (field id, label, parser of its text, Input type)
FIELDS: tuple[tuple[str, str, Callable[[str], float], str], ...] = (
    ("temperature", "temperature", number, "number"),
    ("top_p", "top-p", number, "number"),
    ("top_k", "top-k", integer, "integer"),
    ("seed", "seed", integer, "integer"),
    ("max_tokens", "max tokens", integer, "integer"),
)


def field_texts(sampling: Sampling) -> dict[str, str]:
    p = sampling.params
    return {"temperature": repr(p.temperature), "top_p": repr(p.top_p), "top_k": str(p.top_k),
            "seed": str(p.seed), "max_tokens": str(sampling.max_tokens)}


@dataclass(frozen=True)
class ChatSettings:
    """What the dialog applies: to the open conversation, and, with `make_default`, to new
    conversations (kept in the settings file)."""

    system: str
    sampling: Sampling
    make_default: bool = False


class SamplingForm(Vertical):
    """The system prompt and the five sampling values of one conversation, as fields."""

    DEFAULT_CSS = """
    SamplingForm {
        height: auto;
        & > TextArea { height: 6; margin-bottom: 1; }
        & > Grid {
            grid-size: 4; grid-columns: 12 1fr 12 1fr; grid-gutter: 0 1; height: auto;
        }
        & Grid > Label { height: 1; color: $text-muted; }
        & Grid > Input, & Grid > Input:focus { height: 1; border: none; padding: 0 1; }
        & #sampling-error { color: $text-error; height: auto; display: none; }
        & #sampling-error.-shown { display: block; }
    }
    """

    error: reactive[str] = reactive("")

    def __init__(self, system: str, sampling: Sampling, ctx: int) -> None:
        super().__init__()
        self.system, self.sampling, self.ctx = system, sampling, ctx

    def compose(self) -> ComposeResult:
        yield Label("system prompt (sent first in this conversation; empty: none)")
        yield TextArea(self.system, id="system-prompt", soft_wrap=True, tab_behavior="focus")
        texts = field_texts(self.sampling)
        with Grid():
            for key, label, _, kind in FIELDS:
                yield Label(label)
                yield Input(texts[key], type=kind, id=f"sampling-{key}")  # type: ignore[arg-type]
        yield Label("", id="sampling-error")

    def watch_error(self, error: str) -> None:
        label = self.query_one("#sampling-error", Label)
        label.update(error)
        label.set_class(bool(error), "-shown")

    def read(self) -> tuple[str, Sampling] | None:
        """The fields as (system prompt, sampling); None, every reason shown, when the
        engine's rules refuse a value."""
        problems: list[str] = []
        values: dict[str, float] = {}
        for key, label, parse, _ in FIELDS:
            text = self.query_one(f"#sampling-{key}", Input).value.strip()
            try:
                values[key] = parse(text)
            except argparse.ArgumentTypeError as exc:
                problems.append(f"{label}: {exc}")
        system = self.query_one("#system-prompt", TextArea).text
        try:
            check_text_fits([system], self.ctx)
        except StrataError as exc:
            problems.append(f"system prompt: {exc}")
        sampling = None
        if len(values) == len(FIELDS):
            try:
                params = SamplingParams(temperature=values["temperature"],
                                        top_p=values["top_p"], top_k=int(values["top_k"]),
                                        seed=int(values["seed"]))
                sampling = Sampling(params, int(values["max_tokens"]))
            except FlagError as exc:
                problems += exc.violations
        self.error = "\n".join(problems)
        return None if problems or sampling is None else (system, sampling)


class ChatSettingsScreen(ModalScreen[ChatSettings | None]):
    """The open conversation's system prompt and sampling: ctrl+s or Enter in a field applies,
    Esc closes without a change."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+s", "apply", "Apply", priority=True),
    ]
    DEFAULT_CSS = """
    ChatSettingsScreen {
        align: center middle;
        & > Vertical {
            width: 90%; max-width: 90; height: auto; max-height: 100%;
            border: round $primary; background: $surface; padding: 0 1;
        }
        & #chat-settings-title { text-style: bold; margin-bottom: 1; }
        & Checkbox { border: none; padding: 0; margin-top: 1; height: 1; }
        & #chat-settings-hint { color: $text-muted; }
    }
    """
    HINT = "ctrl+s or Enter applies · Esc closes"

    def __init__(self, title: str, system: str, sampling: Sampling, ctx: int) -> None:
        super().__init__()
        self.conv_title, self.system, self.sampling, self.ctx = title, system, sampling, ctx

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"System prompt and sampling: {self.conv_title or 'new conversation'}",
                        id="chat-settings-title")
            yield SamplingForm(self.system, self.sampling, self.ctx)
            yield Checkbox("also the default of new conversations (kept in the settings)",
                           id="chat-settings-default")
            yield Label(self.HINT, id="chat-settings-hint")

    def on_mount(self) -> None:
        self.query_one("#system-prompt", TextArea).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_apply()

    def action_apply(self) -> None:
        read = self.query_one(SamplingForm).read()
        if read is not None:
            default = self.query_one("#chat-settings-default", Checkbox).value
            self.dismiss(ChatSettings(*read, make_default=default))

    def action_close(self) -> None:
        self.dismiss(None)
