"""ChatLog: the conversation — user messages as text, answers as streaming Markdown."""

from __future__ import annotations

import re
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Markdown, Static

from app.widgets.answer_stream import AnswerStream, StreamTail
from engine.conversation import Conversation

USER_PREVIEW_LINES = 12
# a message longer than this shows its start until asked: drawing 50 MB of Markdown took 35 s
# and 1.6 GB before the first frame
SHOWN_CHARS = 64 * 1024
# C0/C1 control characters other than tab and newline: models can emit them; terminals must not
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    return _CONTROL.sub("\N{REPLACEMENT CHARACTER}", text)


def user_preview(text: str) -> Text:
    """The first lines of a user message; long pastes say how much is hidden."""
    lines = text[:SHOWN_CHARS].splitlines() or [""]
    n_lines = len(lines) + text.count("\n", SHOWN_CHARS)  # counted without a copy
    shown = Text(printable("\n".join(lines[:USER_PREVIEW_LINES])))
    if n_lines > USER_PREVIEW_LINES:
        shown.append(f"\n… {n_lines - USER_PREVIEW_LINES:,} more lines", style="dim italic")
    return shown


class ShowAll(Static, can_focus=True):
    """'… N more characters': a click or Enter shows the whole message."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "show_all", "Show all", show=False)]
    DEFAULT_CSS = """
    ShowAll { color: $text-muted; text-style: italic; padding: 0 1; }
    ShowAll:hover, ShowAll:focus { color: $text-accent; text-style: italic underline; }
    """

    def __init__(self, n_hidden: int) -> None:
        super().__init__(f"… {n_hidden:,} more characters (click, or Enter, to show all)")

    async def action_show_all(self) -> None:
        view = self.parent
        assert isinstance(view, MessageView)
        await view.show_all()

    async def on_click(self, event: events.Click) -> None:
        event.stop()
        await self.action_show_all()


class MessageView(Vertical):
    """One message: a role label and its body; an answer cut short is marked cancelled, one
    whose writer was killed is marked interrupted. A long body shows its first SHOWN_CHARS
    characters until the user asks for all of it."""

    DEFAULT_CSS = """
    MessageView {
        height: auto;
        margin: 0 0 1 0;
        & > Label { color: $text-muted; text-style: bold; }
        &.-user > Label { color: $text-accent; }
        &.-assistant > Label { color: $text-success; }
        & > Static { padding: 0 1; }
        & > Markdown { padding: 0 1; margin: 0; }
        & > .status { color: $text-muted; text-style: italic; display: none; }
        &.-cancelled > Label { color: $text-warning; }
    }
    """

    def __init__(self, role: str, content: str = "", cancelled: bool = False,
                 interrupted: bool = False) -> None:
        super().__init__(classes=f"-{role}")
        self.role, self.content, self.cancelled = role, content, cancelled
        self.interrupted = interrupted
        self.shown_chars = SHOWN_CHARS
        self.set_class(cancelled or interrupted, "-cancelled")

    def compose(self) -> ComposeResult:
        yield Label(self._label())
        if self.role == "user":
            yield Static(user_preview(self.content))
        else:
            yield Static("", classes="status")
            yield Markdown(printable(self.content[: self.shown_chars]))
            yield StreamTail()  # the block being generated, until it is finished
        if len(self.content) > self.shown_chars:
            yield ShowAll(len(self.content) - self.shown_chars)

    async def set_content(self, content: str) -> None:
        """Replace an answer's text (its start, when it is long)."""
        self.content = content
        await self.query(ShowAll).remove()
        await self.query_one(Markdown).update(printable(content[: self.shown_chars]))
        if len(content) > self.shown_chars:
            await self.mount(ShowAll(len(content) - self.shown_chars))

    async def show_all(self) -> None:
        """Draw the whole message (as long as that takes: the user asked)."""
        self.shown_chars = len(self.content)
        await self.query(ShowAll).remove()
        if self.role == "user":
            self.query_one(Static).update(Text(printable(self.content)))
        else:
            await self.query_one(Markdown).update(printable(self.content))

    def set_status(self, text: str) -> None:
        status = self.query_one(".status", Static)
        status.update(text)
        status.display = bool(text)

    def mark_cancelled(self) -> None:
        """Mark the answer as cut short by the user (the label says so)."""
        self.cancelled = True
        self.add_class("-cancelled")
        self.query_one(Label).update(self._label())

    def _label(self) -> str:
        label = "you" if self.role == "user" else self.role
        if self.cancelled:
            return f"{label} · cancelled"
        return f"{label} · interrupted" if self.interrupted else label


WELCOME = "Type a message and press Enter.  F1 shows every key."


class ChatLog(VerticalScroll):
    """Message views; the answer being generated streams into the last Markdown."""

    DEFAULT_CSS = """
    ChatLog {
        height: 1fr;
        padding: 0 1;
        scrollbar-size-vertical: 1;
        & > #chat-empty { color: $text-muted; padding: 1 2; }
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._stream: AnswerStream | None = None
        self._pending: list[MessageView] = []
        self._streamed = False  # the open answer has received text
        self._text: list[str] = []  # what the open answer has received

    def compose(self) -> ComposeResult:
        yield Static(WELCOME, id="chat-empty")

    def welcome(self, description: str) -> None:
        """What the empty chat says: the model's own suggestion first, when it has one."""
        text = f"{description}\n\n{WELCOME}" if description else WELCOME
        self.query_one("#chat-empty", Static).update(text)

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    @property
    def partial(self) -> str:
        """The text the open answer has shown so far ("" when none is open)."""
        return "".join(self._text) if self._stream is not None else ""

    async def show(self, conv: Conversation) -> None:
        """Replace the log with the messages of `conv`."""
        await self._stop_stream()
        self._pending = []
        await self.remove_children(MessageView)
        await self.mount_all([MessageView(m.role, m.content, m.cancelled, m.interrupted)
                              for m in conv.messages])
        self.query_one("#chat-empty").display = not conv.messages
        self.scroll_end(animate=False)

    async def begin_exchange(self, prompt: str) -> None:
        """Show the user's message and an empty answer that tokens will stream into."""
        self.query_one("#chat-empty").display = False
        user, answer = MessageView("user", prompt), MessageView("assistant")
        await self.mount_all([user, answer])
        self._pending = [user, answer]
        answer.query_one(StreamTail).show_status("waiting for the engine…")
        self._streamed = False
        self._text = []
        self._stream = AnswerStream(answer.query_one(Markdown), answer.query_one(StreamTail))
        self.anchor()  # follow the answer as it grows, until the user scrolls away
        self.call_after_refresh(self._make_room, user, answer)

    def _make_room(self, user: MessageView, answer: MessageView) -> None:
        """Scroll the prompt to the top and keep the view below it blank for the answer: it
        streams in without a layout per line (each one reflows the whole screen)."""
        if self._stream is None or self._pending[-1:] != [answer]:  # already answered
            return
        # the prompt's bottom margin, the answer's label and bottom margin
        room = self.scrollable_content_region.height - user.outer_size.height - 3
        answer.query_one(StreamTail).reserve(room)

    async def append(self, text: str) -> None:
        """Stream generated text into the answer; ignored when no answer is open."""
        if self._stream is not None and text:
            self._streamed = True  # the text takes the status line's place
            self._text.append(text)
            await self._stream.write(printable(text))

    def progress(self, text: str) -> None:
        """Say what the engine is doing before the first token (prefill progress)."""
        if self._stream is not None and not self._streamed:
            self._pending[-1].query_one(StreamTail).show_status(text)

    async def finish(self, reply: str, cancelled: bool = False) -> None:
        """Close the answer with the engine's final text (authoritative over the stream).

        `cancelled`: the user cut the answer short; it stays, marked as cancelled.
        """
        await self._stop_stream()
        if self._pending:
            answer = self._pending[-1]
            answer.set_status("" if reply else "(no text: the model ended at once)")
            if cancelled:
                answer.mark_cancelled()
            await answer.set_content(reply)
        self._pending = []

    async def withdraw(self) -> None:
        """Remove the open exchange (cancelled or failed request)."""
        await self._stop_stream()
        for view in self._pending:
            await view.remove()
        self._pending = []
        self.query_one("#chat-empty").display = not self.query(MessageView)

    async def _stop_stream(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.stop()
        # anchored, a log shorter than the view would sit at its bottom: let go, stay at the end
        following = self.is_vertical_scroll_end
        self.anchor(False)
        if following:
            self.scroll_end(animate=False)

