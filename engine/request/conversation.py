"""Conversations: the messages of one chat, rendered into prompt tokens by the chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.errors import ContextFullError, FlagError, TextTooLongError
from engine.request.sampler import SamplingParams

TITLE_CHARS = 60
ROLES = ("system", "user", "assistant")
# a prompt's text cap: this many bytes a token of --ctx (English runs ~4-5 bytes a token, code
# and CJK more): text past it is refused before the chat template or the tokenizer sees it
PROMPT_BYTES_PER_TOKEN = 16
MAX_TOKENS_CEILING = 2**31 - 1  # an answer's token cap, as every integer option


def check_text_fits(texts: Iterable[str], ctx: int) -> None:
    """Refuse, in one line, text that cannot be a prompt of `ctx` tokens: more than
    PROMPT_BYTES_PER_TOKEN bytes a token (TextTooLongError). Cheap: characters bound the bytes
    from below."""
    limit, n_bytes = PROMPT_BYTES_PER_TOKEN * ctx, 0
    for text in texts:
        n_bytes += len(text)  # >= 1 byte a character
        if n_bytes > limit:
            break
        n_bytes += len(text.encode("utf-8", "surrogatepass")) - len(text)
    if n_bytes > limit:
        raise TextTooLongError(
            f"the text is over {limit:,} bytes ({PROMPT_BYTES_PER_TOKEN} a token of --ctx "
            f"{ctx:,}), more than the context can hold; start a new conversation, shorten "
            "the message or raise --ctx")


def check_prompt_fits(n_prompt: int, ctx: int) -> None:
    """The context rule, in one place: a prompt must leave --ctx room for one token of the
    answer (the KV holds the prompt; the answer's tokens follow it). ContextFullError (with
    the numbers) before anything is read, never a 'context full' after seconds of prefill."""
    if n_prompt >= ctx:
        raise ContextFullError(n_prompt, ctx)


def title_of(prompt: str) -> str:
    """A conversation's title from its first user message: the first line, cut."""
    text = prompt.strip()
    return text.splitlines()[0][:TITLE_CHARS] if text else "untitled"


@dataclass(frozen=True)
class Sampling:
    """How a conversation's answers are sampled: the sampler's parameters and the most tokens
    an answer may have. The app keeps one with each conversation; `ServeLoop.chat` takes them
    as arguments."""

    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256

    def __post_init__(self) -> None:
        n = self.max_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_TOKENS_CEILING:
            raise FlagError(f"max tokens {n!r:.24} must be an integer in 1..{MAX_TOKENS_CEILING}")


@dataclass
class Message:
    """One message; `cancelled` marks an answer cut short by the user (its text was shown),
    `interrupted` one whose writer was killed while it streamed (the text stored until then)."""

    role: str  # one of ROLES
    content: str
    created: float = field(default_factory=time.time)
    cancelled: bool = False
    interrupted: bool = False

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass
class Conversation:
    """An ordered list of messages with an id and a title (the first user message, cut).

    `system` is the conversation's system prompt: rendered as its first message when not
    empty. `sampling` is the conversation's own (None: the caller's defaults).
    """

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    messages: list[Message] = field(default_factory=list)
    title: str = ""
    created: float = field(default_factory=time.time)
    system: str = ""
    sampling: Sampling | None = None

    def add(self, role: str, content: str, cancelled: bool = False) -> Message:
        msg = Message(role, content, cancelled=cancelled)
        self.messages.append(msg)
        if not self.title and role == "user":
            self.title = title_of(content)
        return msg

    def pop(self) -> Message:
        """Remove the last message; a title taken from a removed prompt goes with it."""
        msg = self.messages.pop()
        if not any(m.role == "user" for m in self.messages):
            self.title = ""
        return msg

    def as_dicts(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them, the system prompt first."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [m.as_dict() for m in self.messages]

    def to_markdown(self) -> str:
        """Export as Markdown: a heading per message."""
        lines = [f"# {self.title or 'Conversation'}", ""]
        if self.system:
            lines += ["## system prompt", "", self.system.rstrip(), ""]
        for m in self.messages:
            cut = " (cancelled)" if m.cancelled else " (interrupted)" if m.interrupted else ""
            heading = f"## {m.role}{cut}"
            lines += [heading, "", m.content.rstrip(), ""]
        return "\n".join(lines)
