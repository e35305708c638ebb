"""Screens: loading (progress while the engine builds/loads), help, conversation list."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Markdown, OptionList, ProgressBar
from textual.widgets.option_list import Option

from app.search import SEARCH_CHARS, Found, SearchHit
from app.store import ConversationInfo, StoreError
from app.widgets.chat_log import printable
from engine.trace.events import Loading

HELP = """\
# strata chat

*Esc, F1 or q closes this help; the arrows, PgUp/PgDn, space and Home/End scroll it.*

| key | action |
|---|---|
| **Enter** | send the message |
| **ctrl+j** (shift+enter, alt+enter where the terminal reports them) | new line |
| **↑ / ↓** in the input | the prompts sent before, of every conversation, newest first (↑ on the first line, ↓ on the last; the message being written comes back at the bottom) |
| **ctrl+r** | regenerate the last answer (its prompt is sent again; the KV cache reuses everything before it) |
| **ctrl+↑** | select a message: **↑ ↓** (k j) move, **Home/End** first/last, **Esc** back to the input |
| **y** or **c** on a message | copy it to the clipboard (OSC 52, through the terminal) |
| **b** on a message | copy its last code block; again: the block before it |
| **e** on a message | edit it (an answer: its prompt) in the input; Enter sends it in its place, dropping the messages after it; Esc stops editing |
| **r** on a message | answer it again (an answer: its prompt); the messages after the prompt are dropped |
| **Esc** | cancel a running request: the prompt comes back, or the answer so far stays, marked cancelled; in a panel: back to the input |
| **ctrl+n** | new conversation |
| **ctrl+o** | open a saved conversation: type to search the titles and every message (Enter opens at the match), ctrl+r renames, ctrl+d deletes |
| **ctrl+s** | export the conversation to Markdown (the path is shown) |
| **F2** | show / hide the dashboard (below 100 columns it opens above the chat, the input stays; while it is hidden a two-line strip stands for it) |
| **F3** | go to the loan flags panel, focus on its first switch (space toggles; typing or pasting there goes to the input) |
| **F4** | this conversation's system prompt and sampling (temperature, top-p, top-k, seed, max tokens); ctrl+s applies, and can make them the default of new conversations |
| **ctrl+t** | change the theme |
| **ctrl+p** | command palette (loan flags, spec, prefill, …) |
| **F1** | this help |
| **ctrl+q** | quit |

A paste longer than 10 lines or 1,000 characters collapses into a chip that shows its line
and token counts and whether it crosses `STRATA_PREFILL_REPEAT_MIN_TOKENS` (when the repeat
loan is on). The full text is sent.

A copy travels through the terminal (the OSC 52 escape sequence), so it works over ssh; tmux
passes it on with `set -g set-clipboard on`; macOS Terminal ignores it (ctrl+s exports instead).

The flags panel changes the six `STRATA_PREFILL_*` loan flags, spec T and the prefill mode. The
engine checks every change with the same guards as at startup: a refused change shows the
reasons and the control goes back; an accepted change applies from the next message.

The theme, the dashboard, the loan flags and what a new conversation takes (F4's "default"
box) are kept between runs in `settings.toml` (`strata chat --help` says where); options given
on the command line and `STRATA_PREFILL_*` variables win over it. The palette's "Settings:
reset to defaults" puts them all back.
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

    def __init__(self, model: str, url: str | None = None) -> None:
        super().__init__()
        self.model, self.url = model, url

    def compose(self) -> ComposeResult:
        title = f"Connecting to {self.url}" if self.url else f"Starting the engine: {self.model}"
        with Vertical():
            yield Label(title, id="loading-title")
            yield Label("", id="loading-stage")
            yield ProgressBar(total=None, show_eta=False, id="loading-bar")

    def show(self, event: Loading) -> None:
        self.query_one("#loading-stage", Label).update(
            f"{event.stage} ({event.done}/{event.total})"
        )
        self.query_one("#loading-bar", ProgressBar).update(total=event.total, progress=event.done)


class HelpScreen(ModalScreen[None]):
    """Key bindings and what the panels mean; the arrows, PgUp/PgDn, Home/End and space
    scroll it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,q", "dismiss", "Close"),
        Binding("space", "page(1)", "Page down", show=False),
        Binding("shift+space", "page(-1)", "Page up", show=False),
    ]
    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
        & > VerticalScroll {
            width: 90%; max-width: 100; height: 90%;
            border: round $primary; background: $surface; padding: 0 1;
            scrollbar-size-vertical: 1;
            &:focus { border: round $accent; }
        }
        & Markdown { margin: 0; padding: 0; }
    }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body") as body:
            body.border_subtitle = "↑↓ PgUp PgDn scroll · Esc closes"
            yield Markdown(HELP)

    def on_mount(self) -> None:
        self.query_one("#help-body").focus()  # the scroll keys work from the first press

    def action_page(self, direction: int) -> None:
        body = self.query_one("#help-body", VerticalScroll)
        if direction > 0:
            body.scroll_page_down(animate=False)
        else:
            body.scroll_page_up(animate=False)


@dataclass(frozen=True)
class OpenAt:
    """What the conversation list opens: a conversation, and the message a search found in it
    (its position among the conversation's messages; None: the conversation as it was left)."""

    conv_id: str
    message: int | None = None


class ConversationsScreen(ModalScreen[OpenAt | None]):
    """Pick a saved conversation (returns an OpenAt; None when dismissed); search the titles
    and, through `search` (the store's full-text search), the messages: each conversation
    found shows its best match with the words marked, and Enter opens it at that message.
    Rename or delete one. Renames and deletions are posted to the app, which owns the store."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("down", "move(1)", "Next", show=False),
        Binding("up", "move(-1)", "Previous", show=False),
        # before the search field's own ctrl+d (delete right)
        Binding("ctrl+r", "rename", "Rename", priority=True),
        Binding("ctrl+d", "delete", "Delete", priority=True),
    ]
    DEFAULT_CSS = """
    ConversationsScreen {
        align: center middle;
        & > Vertical {
            width: 90%; max-width: 100; height: 80%;
            border: round $primary; background: $surface;
        }
        /* a title and a snippet a line each, cut at the width */
        & OptionList { height: 1fr; border: none; text-wrap: nowrap; text-overflow: ellipsis; }
        & Input, & Input:focus { border: none; height: 1; padding: 0 1; margin: 0 0 1 0; }
        & #conv-rename { display: none; }
        & #conv-rename.-renaming { display: block; }
        & #conv-hint { color: $text-muted; padding: 0 1; }
        & #conv-hint.-warning { color: $text-warning; }
    }
    """
    HINT = "Enter opens · ctrl+r renames · ctrl+d deletes · Esc closes"
    HIT_STYLE = "bold reverse"  # a matched word in a snippet, legible in every theme

    @dataclass
    class Renamed(Message):
        """The user gave conversation `conv_id` the title `title`."""

        conv_id: str
        title: str

    @dataclass
    class Deleted(Message):
        """The user deleted conversation `conv_id`."""

        conv_id: str

    def __init__(self, conversations: list[ConversationInfo], current: str | None,
                 search: Callable[[str], Found] | None = None) -> None:
        super().__init__()
        self.conversations, self.current = list(conversations), current
        self._search = search
        self._hits: dict[str, SearchHit] = {}  # the messages' matches, by conversation
        self._note = ""  # what the search says (a substring search, more matches, a failure)
        self._delete_armed: str | None = None  # ctrl+d once: this id; twice: deleted

    def compose(self) -> ComposeResult:
        what = "titles and messages" if self._search else "titles"
        with Vertical():
            yield Label(" Conversations", id="conv-title")
            yield Input(placeholder=f"search the {what}…", id="conv-search",
                        max_length=SEARCH_CHARS)
            yield OptionList(id="conv-list")
            yield Input(id="conv-rename")
            yield Label(self.HINT, id="conv-hint")

    def on_mount(self) -> None:
        self._fill()
        self.query_one("#conv-search", Input).focus()

    # -- the list ----------------------------------------------------------------------------
    def shown(self) -> list[ConversationInfo]:
        """The conversations whose title holds the search or whose messages hold its words
        (all when it is empty), newest first."""
        query = self.query_one("#conv-search", Input).value.strip().casefold()
        return [c for c in self.conversations
                if query in (c.title or "untitled").casefold() or c.id in self._hits]

    def hit(self, conv_id: str) -> SearchHit | None:
        """The message the search found in conversation `conv_id`, if any."""
        return self._hits.get(conv_id)

    def _find(self) -> None:
        """Search the messages for what the search field holds (on each change)."""
        query = self.query_one("#conv-search", Input).value.strip()
        self._hits, self._note = {}, ""
        if not query or self._search is None:
            return
        try:
            found = self._search(query)
        except StoreError as exc:
            self._note = f"The messages cannot be searched: {exc}"
            return
        self._hits = {h.conv_id: h for h in found.hits}
        more = "more messages match than are shown: add a word" if found.more else ""
        self._note = " · ".join(filter(None, (found.note, more)))

    def _option(self, c: ConversationInfo) -> Option:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
        prompt = Text()
        prompt.append(f"{'● ' if c.id == self.current else '  '}{printable(c.title or 'untitled')}")
        prompt.append(f"  {c.n_messages} messages · {when}", style="dim")
        hit = self._hits.get(c.id)
        if hit is not None:
            prompt.append(f"\n    {'you' if hit.role == 'user' else hit.role}: ", style="dim")
            snippet = Text(printable(hit.snippet))
            for start, end in hit.marks:
                snippet.stylize(self.HIT_STYLE, start, end)
            prompt.append_text(snippet)
            if hit.n_hits > 1:
                prompt.append(f"  +{hit.n_hits - 1:,} more", style="dim")
        return Option(prompt, id=c.id)

    def _fill(self) -> None:
        options = self.query_one("#conv-list", OptionList)
        shown = self.shown()
        if shown:
            options.set_options(self._option(c) for c in shown)
            options.highlighted = 0
        elif self.conversations:
            options.set_options([Option("nothing matches the search", disabled=True)])
        else:
            options.set_options([Option("no saved conversations yet", disabled=True)])

    def _selected(self) -> ConversationInfo | None:
        options = self.query_one("#conv-list", OptionList)
        if options.highlighted is None:
            return None
        conv_id = options.get_option_at_index(options.highlighted).id
        return next((c for c in self.conversations if c.id == conv_id), None)

    def _hint(self, text: str = "", warning: bool = False) -> None:
        """Show `text` under the list; by default what the search says, else the keys."""
        hint = self.query_one("#conv-hint", Label)
        hint.update(text or self._note or self.HINT)
        hint.set_class(warning or (not text and bool(self._note)), "-warning")

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "conv-search":
            self._delete_armed = None
            self._find()
            self._hint()
            self._fill()

    def action_move(self, step: int) -> None:
        options = self.query_one("#conv-list", OptionList)
        if step > 0:
            options.action_cursor_down()
        else:
            options.action_cursor_up()

    # -- open --------------------------------------------------------------------------------
    def _open(self, conv_id: str) -> None:
        hit = self._hits.get(conv_id)
        self.dismiss(OpenAt(conv_id, hit.message if hit else None))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        assert event.option.id is not None
        self._open(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id == "conv-rename":
            self._finish_rename(event.value)
            return
        selected = self._selected()
        if selected is not None:
            self._open(selected.id)

    def action_close(self) -> None:
        if self.renaming:
            self._end_rename()  # Esc while renaming leaves the title as it was
            return
        self.dismiss(None)

    # -- rename ------------------------------------------------------------------------------
    @property
    def renaming(self) -> bool:
        return self.query_one("#conv-rename").has_class("-renaming")

    def action_rename(self) -> None:
        selected = self._selected()
        if selected is None or self.renaming:
            return
        rename = self.query_one("#conv-rename", Input)
        rename.value = selected.title
        rename.add_class("-renaming")
        rename.focus()
        self._hint(f"New title for {selected.title or 'untitled'!r}: Enter saves, Esc keeps it")

    def _finish_rename(self, title: str) -> None:
        selected, title = self._selected(), " ".join(title.split())
        if selected is not None and title and title != selected.title:
            self.conversations = [
                replace(c, title=title) if c.id == selected.id else c for c in self.conversations
            ]
            self.post_message(self.Renamed(selected.id, title))
            self._fill()
            self._highlight(selected.id)
        self._end_rename()

    def _end_rename(self) -> None:
        self.query_one("#conv-rename", Input).remove_class("-renaming")
        self.query_one("#conv-search", Input).focus()
        self._hint()

    def _highlight(self, conv_id: str) -> None:
        options = self.query_one("#conv-list", OptionList)
        for i, c in enumerate(self.shown()):
            if c.id == conv_id:
                options.highlighted = i

    # -- delete ------------------------------------------------------------------------------
    def action_delete(self) -> None:
        selected = self._selected()
        if selected is None or self.renaming:
            return
        if self._delete_armed != selected.id:  # the first press asks
            self._delete_armed = selected.id
            self._hint(f"ctrl+d again deletes {selected.title or 'untitled'!r} for good",
                       warning=True)
            return
        self._delete_armed = None
        self.conversations = [c for c in self.conversations if c.id != selected.id]
        self.post_message(self.Deleted(selected.id))
        self._fill()
        self._hint(f"Deleted {selected.title or 'untitled'!r}.")
