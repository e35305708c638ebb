"""Conversations: the messages of one chat, rendered into prompt tokens by the chat template."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str
    created: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass
class Conversation:
    """An ordered list of messages with an id and a title (the first user message, cut)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    messages: list[Message] = field(default_factory=list)
    title: str = ""
    created: float = field(default_factory=time.time)

    def add(self, role: str, content: str) -> Message:
        msg = Message(role, content)
        self.messages.append(msg)
        if not self.title and role == "user":
            first = content.strip().splitlines()[0] if content.strip() else "untitled"
            self.title = first[:60]
        return msg

    def pop(self) -> Message:
        return self.messages.pop()

    def as_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]

    def to_markdown(self) -> str:
        """Export as Markdown: a heading per message."""
        lines = [f"# {self.title or 'Conversation'}", ""]
        for m in self.messages:
            lines += [f"## {m.role}", "", m.content.rstrip(), ""]
        return "\n".join(lines)
