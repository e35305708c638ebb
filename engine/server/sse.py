"""Server-sent events at the ASGI level: the frames, the response start, and a watch for the
client going away (a request whose client left is cancelled at once, even while nothing is
being sent: in the queue, or during a long prefill).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a reverse proxy passes each event on at once
]
KEEPALIVE_S = 5.0  # a comment this often while nothing else is sent
FLUSH_HZ = 50  # a stream sends what the engine published this often (one write for all of it)


def data(obj: Any, event: str | None = None) -> bytes:
    """One event: `event: NAME` (when given) and `data: JSON`."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment line: clients ignore it; it keeps the connection (and its proxies) alive."""
    return f": {text}\n\n".encode()


DONE = b"data: [DONE]\n\n"


async def start(send: Send, status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": HEADERS})


async def body(send: Send, chunk: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": chunk, "more_body": more})


async def disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def first(work: Awaitable[Any], gone: asyncio.Future[None],
                timeout_s: float | None = None) -> tuple[bool, Any]:
    """Await `work` unless the client goes first (or `timeout_s` passes): (True, its result),
    or (False, None) with `work` cancelled."""
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return True, task.result()
    task.cancel()
    return False, None
