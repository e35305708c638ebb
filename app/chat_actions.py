"""What the chat's message actions act on: the code blocks of a message (to copy one), the
point where sending a message again cuts the conversation (edit-and-resend, regenerate), and
putting the cut messages back when that request ends with no answer.

Pure functions over `Conversation`; the widgets and the app call them, nothing here draws.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from markdown_it import MarkdownIt

from engine.request.conversation import Conversation, Message, title_of

# OSC 52 sends the text base64-encoded through the terminal: past this many characters a copy
# is refused with a notice (terminals cap the sequence, some freeze on megabytes)
COPY_MAX_CHARS = 1024 * 1024
# terminals known to ignore OSC 52 ($TERM_PROGRAM): the copy notice says so
NO_OSC52 = {"Apple_Terminal": "macOS Terminal"}

_PARSER = MarkdownIt("commonmark")


@dataclass(frozen=True)
class CodeBlock:
    """A fenced (or indented) code block of a message: its text and its language tag."""

    code: str
    lang: str = ""

    @property
    def n_lines(self) -> int:
        return len(self.code.splitlines())


def code_blocks(text: str) -> list[CodeBlock]:
    """The code blocks of a Markdown message, in order (nested ones too: in a list, a quote)."""
    return [CodeBlock(t.content, (t.info or "").split(maxsplit=1)[0] if t.info.strip() else "")
            for t in _PARSER.parse(text) if t.type in ("fence", "code_block")]


def copy_refusal(text: str, what: str) -> str:
    """Why `text` is not copied ("" when it is): nothing in it, or past COPY_MAX_CHARS."""
    if not text:
        return f"The {what} has no text yet."
    if len(text) > COPY_MAX_CHARS:
        return (f"The {what} is {len(text):,} characters; the terminal clipboard (OSC 52) "
                f"takes at most {COPY_MAX_CHARS:,} here. ctrl+s exports the conversation "
                "to a Markdown file instead.")
    return ""


def copy_notice(n_chars: int, what: str, first: bool,
                env: Mapping[str, str] = os.environ) -> tuple[str, bool]:
    """The notice after a copy, and whether it is a warning: the count, and (on the first
    copy, or always where the terminal is known to ignore it) how the copy travels."""
    done = f"Copied the {what}: {n_chars:,} characters."
    terminal = NO_OSC52.get(env.get("TERM_PROGRAM", ""))
    if terminal:
        return (f"{done} {terminal} ignores clipboard writes from programs (OSC 52): use a "
                "terminal that takes them (iTerm2, kitty, WezTerm, Windows Terminal), or "
                "ctrl+s to export."), True
    if not first:
        return done, False
    how = ("It went through the terminal (OSC 52): if nothing pastes, the terminal does not "
           "take clipboard writes from programs")
    if env.get("TMUX"):
        how += "; in tmux: set -g set-clipboard on"
    return f"{done} {how}.", False


@dataclass(frozen=True, eq=False)
class EditTarget:
    """A user message being edited in the input: `message` of conversation `conv_id`, at
    `index`, with `n_after` messages after it (dropped when the edit is sent)."""

    conv_id: str
    message: Message
    index: int
    n_after: int


def edit_target(conv: Conversation, index: int) -> EditTarget:
    return EditTarget(conv.id, conv.messages[index], index, len(conv.messages) - index - 1)


def find_edited(conv: Conversation, target: EditTarget) -> int | None:
    """Where the edited message is in `conv` now; None when it is gone (another
    conversation opened, or the conversation reloaded)."""
    if target.conv_id != conv.id:
        return None
    return next((i for i, m in enumerate(conv.messages) if m is target.message), None)


def conversation_before(conv: Conversation, index: int) -> Conversation:
    """`conv` as it will be when the message at `index` is sent again (the engine's
    preview of the edited message asks about this one)."""
    return replace(conv, messages=conv.messages[:index])


@dataclass
class Resend:
    """A message sent again: `conv` was cut at `index` (that message and every one after it
    dropped, kept in `dropped` to put back if the request ends with no answer).
    `regenerate`: the same prompt again, nothing of it in the input."""

    index: int
    prompt: str
    regenerate: bool
    dropped: list[Message] = field(default_factory=list)


def last_prompt_index(conv: Conversation) -> int | None:
    """The index of the last user message (the one the last answer answers), if any."""
    for i in range(len(conv.messages) - 1, -1, -1):
        if conv.messages[i].role == "user":
            return i
    return None


def prompt_index_of(conv: Conversation, index: int) -> int | None:
    """The user message an answer at `index` answers (the last one before it), if any."""
    for i in range(min(index, len(conv.messages) - 1), -1, -1):
        if conv.messages[i].role == "user":
            return i
    return None


def cut(conv: Conversation, index: int) -> list[Message]:
    """Remove the message at `index` and every one after it; returns them, in order. The
    title goes with the last prompt removed (Conversation.pop's rule)."""
    assert 0 <= index <= len(conv.messages), f"cut at {index} of {len(conv.messages)}"
    dropped = conv.messages[index:]
    for _ in dropped:
        conv.pop()
    return dropped


def put_back(conv: Conversation, dropped: list[Message]) -> None:
    """Undo `cut` (after the request that replaced them ended with no answer)."""
    conv.messages.extend(dropped)
    if not conv.title:
        first = next((m for m in conv.messages if m.role == "user"), None)
        conv.title = title_of(first.content) if first is not None else ""
