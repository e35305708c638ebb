"""ChatLog: the conversation — user messages as text, answers as streaming Markdown.

Only the messages in or near the view are laid out. Textual lays out every widget of the
screen on each layout, and a new width re-wraps them all: forty long Markdown answers (some
1,400 widgets) took seconds of the UI thread on a resize. A message more than NEAR_VIEWS view
heights above or below the view is folded: its children leave the layout and it stands as
blank lines as tall as it was (at another width, an estimate), until the view comes near it.
The message at the top of the view stays there across a resize and across folds (its place is
put back after the layout), and a chat at its end stays at its end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Label, Markdown, Static

from app.chat_actions import CodeBlock, code_blocks, copy_notice, copy_refusal
from app.widgets.answer_stream import AnswerStream, StreamTail
from engine.request.conversation import Conversation

USER_PREVIEW_LINES = 12
# a message longer than this shows its start until asked: drawing 50 MB of Markdown took 35 s
# and 1.6 GB before the first frame
SHOWN_CHARS = 64 * 1024
# C0/C1 control characters other than tab and newline: models can emit them; terminals must not
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
NEAR_VIEWS = 1.0  # messages within this many view heights above or below the view stay laid out


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


@dataclass(frozen=True)
class Anchor:
    """The message at the top of the chat's view: `lines` down it the view starts, `share` of
    its height, at `width`."""

    view: MessageView
    lines: int
    share: float
    width: int


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


class MessageView(Vertical, can_focus=True):
    """One message: a role label and its body; an answer cut short is marked cancelled, one
    whose writer was killed is marked interrupted. A long body shows its first SHOWN_CHARS
    characters until the user asks for all of it.

    Focused (ctrl+up from the input, then up/down), it copies itself (y or c, as elia) or its
    code blocks (b: the last, again for the one before), puts a prompt back into the input to
    edit and send again (e; on an answer, its prompt), or answers again (r; the messages after
    the prompt are dropped).
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y,c", "copy", "Copy"),
        Binding("b", "copy_code", "Copy code"),
        Binding("e", "edit", "Edit"),
        Binding("r", "regenerate", "Regenerate"),
        Binding("up,k", "move(-1)", "Previous", show=False),
        Binding("down,j", "move(1)", "Next", show=False),
        Binding("home,g", "move_to(0)", "First", show=False),
        Binding("end,G", "move_to(-1)", "Last", show=False),
    ]

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
        &:focus { background: $accent 15%; }
        &:focus > Label { text-style: bold reverse; }
    }
    """

    def __init__(self, role: str, content: str = "", cancelled: bool = False,
                 interrupted: bool = False) -> None:
        super().__init__(classes=f"-{role}")
        self.role, self.content, self.cancelled = role, content, cancelled
        self.interrupted = interrupted
        self.shown_chars = SHOWN_CHARS
        self.full_renders = 0  # the body parsed and drawn whole (a streamed answer is not)
        self.set_class(cancelled or interrupted, "-cancelled")
        self._block = 0  # the code block `b` copied last (0: none yet; counted from the end)
        self._blocks_of: tuple[str, list[CodeBlock]] = ("", [])
        self._status = ""
        self.folded = False  # out of the layout, standing as blank lines (`fold`)
        self._measured = (0, 0)  # (width, height) when it was folded

    # -- folded: out of the layout while far from the view -----------------------------------
    def fold(self, width: int) -> None:
        """Stand as blank lines as tall as the message is at `width`: its children leave the
        layout (a new layout of the chat, or a resize, does not lay them out again). Folded
        at another width than it was laid out at, the height is an estimate."""
        if not self.folded:
            self.folded = True
            self._measured = (width, self.outer_size.height)
            for child in self.children:
                child.display = False
        self.styles.height = self.height_at(width)

    def unfold(self) -> None:
        """Lay the message out again, whole."""
        if self.folded:
            self.folded = False
            for child in self.children:
                child.display = bool(self._status) if child.has_class("status") else True
            self.styles.height = None  # auto again

    def height_at(self, width: int) -> int:
        """Its height at `width` while folded: as measured, or scaled from it (the label's
        line stays, the body's lines wrap the inverse of the width)."""
        measured_width, height = self._measured
        if width == measured_width or not measured_width or height < 2:
            return height
        return max(2, round(1 + (height - 1) * measured_width / max(1, width)))

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
        self.unfold()
        self.content = content
        await self.query(ShowAll).remove()
        self.full_renders += 1
        await self.query_one(Markdown).update(printable(content[: self.shown_chars]))
        if len(content) > self.shown_chars:
            await self.mount(ShowAll(len(content) - self.shown_chars))

    async def show_all(self) -> None:
        """Draw the whole message (as long as that takes: the user asked)."""
        self.unfold()
        self.shown_chars = len(self.content)
        await self.query(ShowAll).remove()
        if self.role == "user":
            self.query_one(Static).update(Text(printable(self.content)))
        else:
            self.full_renders += 1
            await self.query_one(Markdown).update(printable(self.content))

    def set_status(self, text: str) -> None:
        self._status = text
        status = self.query_one(".status", Static)
        status.update(text)
        status.display = bool(text) and not self.folded

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

    # -- actions on a focused message --------------------------------------------------------
    @property
    def _log(self) -> ChatLog:
        return self.query_ancestor(ChatLog)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "copy_code":
            return bool(self._code_blocks()) or None  # None: greyed, the key still taken
        return True

    def _code_blocks(self) -> list[CodeBlock]:
        """The message's code blocks (parsed once per text: the footer asks on each focus)."""
        if self._blocks_of[0] != self.content:
            self._blocks_of = (self.content, code_blocks(self.content))
        return self._blocks_of[1]

    def action_copy(self) -> None:
        self._log.copy(self.content, "message" if self.role == "user" else "answer")

    def action_copy_code(self) -> None:
        """Copy the last code block; each press again, the one before it (round)."""
        blocks = self._code_blocks()
        if not blocks:
            self.notify("This message has no code block.", severity="warning", timeout=3)
            return
        self._block = self._block % len(blocks) + 1
        index = len(blocks) - self._block
        block = blocks[index]
        n = block.n_lines
        lines = f"{n:,} line{'' if n == 1 else 's'}{f', {block.lang}' if block.lang else ''}"
        self._log.copy(block.code, f"code block {index + 1} of {len(blocks)} ({lines})")

    def action_edit(self) -> None:
        self.post_message(ChatLog.Edit(self._log.index_of(self)))

    def action_regenerate(self) -> None:
        self.post_message(ChatLog.Regenerate(self._log.index_of(self)))

    async def action_move(self, step: int) -> None:
        """Focus the message `step` away; past the last one, the input."""
        views = self._log.views
        index = views.index(self) + step
        if index >= len(views):
            await self.run_action("app.focus_input")
        else:
            views[max(0, index)].focus()

    def action_move_to(self, index: int) -> None:
        self._log.views[index].focus()


WELCOME = "Type a message and press Enter.  F1 shows every key."


class ChatLog(VerticalScroll):
    """Message views; the answer being generated streams into the last Markdown.

    A focused message posts `Edit` or `Regenerate` with its index in the conversation (the
    views are the conversation's messages, in order); the app acts on them.
    """

    @dataclass
    class Edit(Message):
        """Put the message at `index` (an answer: its prompt) into the input, to be sent
        again in its place."""

        index: int

    @dataclass
    class Regenerate(Message):
        """Answer again the message at `index` (an answer: its prompt); what follows the
        prompt is dropped."""

        index: int

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
        self._copied = False  # the first copy's notice says how the copy travels
        # the latest message is in view: it stays in view while the messages mount (their
        # Markdown lays out later) and re-wrap on a resize, until the user scrolls up
        self._at_end = True
        self._width = 0  # the width the messages were last laid out at
        self._anchor: Anchor | None = None  # the message at the top of the view
        self._anchor_at: tuple[int, int] | None = None  # its top and height when noted
        self._scroll_seen = 0.0  # scroll_y when the anchor was noted or put back
        self._fold_due = False

    def compose(self) -> ComposeResult:
        yield Static(WELCOME, id="chat-empty")

    def on_mount(self) -> None:
        self.watch(self, "scroll_y", self._scrolled, init=False)
        self.watch(self, "virtual_size", self._keep_end, init=False)
        self.screen.screen_layout_refresh_signal.subscribe(self, self._laid_out)

    def on_resize(self, event: events.Resize) -> None:
        self._keep_end()

    def _scrolled(self, scroll_y: float) -> None:
        self._at_end = scroll_y >= self.max_scroll_y

    def _keep_end(self) -> None:
        if self._at_end and self.scroll_y < self.max_scroll_y:
            self.scroll_end(animate=False, immediate=True)

    # -- laying out only what is near the view -----------------------------------------------
    def _placed(self) -> dict[MessageView, tuple[int, int]]:
        """Each message view's top and height in the log, as last laid out (in order)."""
        placed: dict[MessageView, tuple[int, int]] = {}
        y = margin_below = 0
        for view in self.query_children(MessageView):
            if not view.display:
                continue
            margin = view.styles.margin
            y += max(margin_below, margin.top)  # adjacent margins overlap
            height = view.outer_size.height
            placed[view] = (y, height)
            y += height
            margin_below = margin.bottom
        return placed

    def _note_top(self, placed: dict[MessageView, tuple[int, int]]) -> None:
        """Note the message at the top of the view, how far down it the view starts (lines,
        and a share of its height for another width) and where it is now."""
        scroll_y = self.scroll_y
        self._anchor = None
        for view, (top, height) in placed.items():
            if top + height > scroll_y:
                lines = max(0, round(scroll_y) - top)
                self._anchor = Anchor(view, lines, lines / max(1, height), self._width)
                break
        self._anchor_at = self._place_of_anchor(placed)
        self._scroll_seen = self.scroll_y

    def _place_of_anchor(self, placed: dict[MessageView, tuple[int, int]]
                         ) -> tuple[int, int] | None:
        return placed.get(self._anchor.view) if self._anchor is not None else None

    def _laid_out(self, _screen: object) -> None:
        """After each layout or scroll of the screen. A new width re-estimates the folded
        messages. A layout that moved the message at the top of the view (a new width, a
        message above it folded or unfolded) scrolls it back to where it was in the view; a
        scroll (the user's) notes which message is at the top now. Then the messages far from
        the view are folded, those near it unfolded."""
        width = self.scrollable_content_region.width
        if not width:
            return
        if width != self._width:
            self._width = width
            for view in self.views:
                if view.folded:
                    view.fold(width)  # the estimate at this width: the next layout moves them
        placed = self._placed()
        anchor_at = self._place_of_anchor(placed)
        if self._at_end:
            self._keep_end()
            self._note_top(placed)
        elif anchor_at is not None and anchor_at != self._anchor_at:
            self._put_back(anchor_at)
        elif anchor_at is None or self.scroll_y != self._scroll_seen:
            self._note_top(placed)
        if not self._fold_due:
            self._fold_due = True
            self.call_after_refresh(self._fold_far)

    def _put_back(self, anchor_at: tuple[int, int]) -> None:
        """Scroll the message noted at the top of the view back to where it was in the view:
        as many lines down it, or (at another width) as large a share of its height."""
        assert self._anchor is not None
        top, height = anchor_at
        anchor = self._anchor
        lines = anchor.lines if anchor.width == self._width else round(anchor.share * height)
        self.scroll_to(y=top + lines, animate=False, immediate=True)
        self._anchor_at, self._scroll_seen = anchor_at, self.scroll_y

    def _fold_far(self) -> None:
        """Fold the messages far from the view, unfold those near it (the open exchange and the
        message holding the focus are never folded); the layout this takes puts the message at
        the top of the view back (`_laid_out`)."""
        self._fold_due = False
        view_height = self.scrollable_content_region.height
        if not view_height or not self._width:
            return
        placed = self._placed()
        if self._place_of_anchor(placed) != self._anchor_at:
            return  # laid out since, not put back yet: `_laid_out` comes and calls again
        near_top = self.scroll_y - NEAR_VIEWS * view_height
        near_bottom = self.scroll_y + (1 + NEAR_VIEWS) * view_height
        focused = self.screen.focused
        kept = {*self._pending, *(focused.ancestors_with_self if focused is not None else ())}
        for view, (top, height) in placed.items():
            if not height and not view.folded:
                continue  # not laid out yet
            near = (top < near_bottom and top + height > near_top) or view in kept
            if near and view.folded:
                view.unfold()
            elif not near and not view.folded:
                view.fold(self._width)

    @property
    def laid_out(self) -> list[MessageView]:
        """The message views laid out whole (the others are folded, far from the view)."""
        return [view for view in self.views if not view.folded]

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
        self._at_end = True  # reopened at the latest message
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

        `cancelled`: the user cut the answer short; it stays, marked as cancelled. An answer
        that streamed whole is not drawn again: its Markdown holds it, block by block.
        """
        streamed = self.partial
        await self._stop_stream()
        if self._pending:
            answer = self._pending[-1]
            answer.set_status("" if reply else "(no text: the model ended at once)")
            if cancelled:
                answer.mark_cancelled()
            if streamed == reply and len(reply) <= answer.shown_chars:
                answer.content = reply
            else:  # the engine's text differs, or it is long: only its start shows
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

    # -- selecting and acting on messages ----------------------------------------------------
    @property
    def views(self) -> list[MessageView]:
        """The message views, in the conversation's order."""
        return list(self.query_children(MessageView))

    def index_of(self, view: MessageView) -> int:
        return self.views.index(view)

    def focus_message(self, index: int = -1) -> bool:
        """Focus the message at `index` (default: the last); False when there is none."""
        views = self.views
        if not views:
            return False
        views[index].focus()
        return True

    def reveal(self, index: int) -> None:
        """Focus the message at `index` and scroll it to the top (a search's match): once laid
        out, after the end `show` scrolls to."""
        views = self.views
        if 0 <= index < len(views):
            views[index].focus(scroll_visible=False)
            self.call_after_refresh(self.scroll_to_widget, views[index], top=True,
                                    animate=False)

    def copy(self, text: str, what: str) -> None:
        """Copy `text` to the clipboard through the terminal (OSC 52), and say so."""
        refusal = copy_refusal(text, what)
        if refusal:
            self.notify(refusal, title="Copy", severity="warning", timeout=8)
            return
        self.app.copy_to_clipboard(text)
        notice, warn = copy_notice(len(text), what, first=not self._copied)
        self._copied = True
        self.notify(notice, title="Copy", severity="warning" if warn else "information",
                    timeout=8 if warn or len(notice) > 60 else 3)

    async def cut(self, index: int) -> None:
        """Remove the message views from `index` on (a message sent again replaces them)."""
        assert self._stream is None, "cut while an answer streams"
        await self.remove_children(self.views[index:])
        self.query_one("#chat-empty").display = not self.views
