"""Screens: loading (progress while the engine builds/loads), help, conversation list."""

from __future__ import annotations

import time
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Markdown, OptionList, ProgressBar
from textual.widgets.option_list import Option

from app.store import ConversationInfo
from engine.events import Loading

HELP = """\
# strata chat

| key | action |
|---|---|
| **Enter** | send the message |
| **ctrl+j** (shift+enter, alt+enter where the terminal reports them) | new line |
| **Esc** | cancel the running prefill or generation (the prompt comes back); from a panel, back to the input |
| **ctrl+n** | new conversation |
| **ctrl+o** | open a saved conversation |
| **ctrl+s** | export the conversation to Markdown (the path is shown) |
| **F2** | show / hide the dashboard |
| **F3** | go to the loan flags panel (typing or pasting there goes to the input) |
| **ctrl+t** | change the theme |
| **ctrl+p** | command palette (loan flags, spec, prefill, …) |
| **F1** | this help |
| **ctrl+q** | quit |

A paste longer than 10 lines or 1,000 characters collapses into a chip that shows its line
and token counts and whether it crosses `STRATA_PREFILL_REPEAT_MIN_TOKENS` (when the repeat
loan is on). The full text is sent.

The flags panel changes the six `STRATA_PREFILL_*` loan flags, spec T and the prefill mode. The
engine checks every change with the same guards as at startup: a refused change shows the
reasons and the control goes back; an accepted change applies from the next message.
"""


class LoadingScreen(ModalScreen[None]):
    """Shown until the engine is ready; draws `Loading` events."""

    DEFAULT_CSS = """
    LoadingScreen {
        align: center middle;
        & > Vertical {
            width: 60; height: auto; padding: 1 2;
            border: round $primary; background: $surface;
        }
        & Label { width: 1fr; }
        & ProgressBar { margin-top: 1; }
        & Bar { width: 1fr; }
    }
    """

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Starting the engine: {self.model}", id="loading-title")
            yield Label("", id="loading-stage")
            yield ProgressBar(total=None, show_eta=False, id="loading-bar")

    def show(self, event: Loading) -> None:
        self.query_one("#loading-stage", Label).update(
            f"{event.stage} ({event.done}/{event.total})"
        )
        self.query_one("#loading-bar", ProgressBar).update(total=event.total, progress=event.done)


class HelpScreen(ModalScreen[None]):
    """Key bindings and what the panels mean."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,f1,q", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
        & > Markdown {
            width: 90%; max-width: 100; height: 90%;
            border: round $primary; background: $surface; padding: 0 1;
            overflow-y: auto;
        }
    }
    """

    def compose(self) -> ComposeResult:
        yield Markdown(HELP)


class ConversationsScreen(ModalScreen[str | None]):
    """Pick a saved conversation; returns its id (None when dismissed)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Close")]
    DEFAULT_CSS = """
    ConversationsScreen {
        align: center middle;
        & > Vertical {
            width: 90%; max-width: 100; height: 80%;
            border: round $primary; background: $surface;
        }
        & OptionList { height: 1fr; border: none; }
    }
    """

    def __init__(self, conversations: list[ConversationInfo], current: str | None) -> None:
        super().__init__()
        self.conversations, self.current = conversations, current

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(" Conversations (Enter opens, Esc closes)")
            options = [
                Option(
                    f"{'● ' if c.id == self.current else '  '}{c.title or 'untitled'}  "
                    f"[dim]{c.n_messages} messages · "
                    f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(c.updated))}[/]",
                    id=c.id,
                )
                for c in self.conversations
            ]
            yield OptionList(*options or [Option("no saved conversations yet", disabled=True)])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)
