"""RequestLabel: which request a dashboard panel shows, in words for its caption.

A panel that draws one request's figures (timing, prompt plan, loan timeline) must say whose
they are: the request running now, the last one finished, or the last one of a conversation
the user has left (ctrl+n, another conversation opened).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.trace.events import Event, RequestDone, RequestStarted


@dataclass(frozen=True)
class RequestLabel:
    """The request a panel shows. `request_id` 0: none started since the app connected (a
    RequestDone may still arrive: a server's request that began before)."""

    request_id: int = 0
    prompt_tokens: int = 0
    running: bool = False
    cancelled: bool = False
    failed: bool = False
    left_for: str = ""  # "new conversation" when the user left the request's conversation

    def after(self, event: Event) -> RequestLabel:
        """The label once `event` is applied (itself for events about no request)."""
        if isinstance(event, RequestStarted):
            return RequestLabel(event.request_id, event.prompt_tokens, running=True)
        if isinstance(event, RequestDone):
            return replace(self, prompt_tokens=event.prompt_tokens or self.prompt_tokens,
                           running=False, cancelled=event.cancelled, failed=event.failed)
        return self

    def left(self, why: str) -> RequestLabel:
        """The user went to another conversation (`why`: "new conversation"); a request still
        running keeps its label (it belongs to the conversation it was sent in)."""
        return self if self.running or not (self.request_id or self.prompt_tokens) else replace(
            self, left_for=why)

    def text(self) -> str:
        """'request 12 · running', 'request 12 · prompt 5,570 tokens', '… · cancelled' (or
        failed),
        'new conversation: last request 11'; '' before any request."""
        name = f"request {self.request_id}" if self.request_id else "last request"
        if self.left_for:
            return f"{self.left_for}: last {name}" if self.request_id else self.left_for
        if self.running:
            return f"{name} · running"
        if not (self.request_id or self.prompt_tokens):
            return ""
        tail = " · failed" if self.failed else " · cancelled" if self.cancelled else ""
        return f"{name} · prompt {self.prompt_tokens:,} tokens{tail}"
