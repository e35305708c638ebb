"""Connections: how many the server holds open, and how long one may take to say what it wants.

uvicorn bounds neither: a connection that never sends a byte stays open for ever, one that
sends its request head a byte at a time restarts the keep-alive timer with every byte, and it
accepts until the process runs out of file descriptors (then every accept fails and is logged).
`Connections.protocol()` is uvicorn's h11 protocol with both bounds:

- a head deadline: a request's line and headers must be complete within `header_timeout_s`
  of the connection opening, or of the previous response ending (a kept-alive connection);
  otherwise the connection is closed;
- a cap: past `max_connections` open, the connection idle longest (no request in progress)
  is closed to make room; when every one is busy with a request the new one is answered 503
  and closed. The cap stays below the process's file-descriptor limit (`fd_limit`), which is
  raised to its hard limit first.

A request body's deadline is the application's (`Service.read_body`: a 408).
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

FD_RESERVE = 128  # descriptors kept for the engine (model file, pipes, the CUDA driver)


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # a container may refuse: the soft limit stays
            pass
    return soft


def connection_cap(wanted: int, fd_limit: int) -> int:
    """`wanted`, or fewer where the file-descriptor limit leaves less room than that."""
    return max(1, min(wanted, fd_limit - FD_RESERVE))


class Connections:
    """One server's open connections, the idle ones in the order they became idle, and what
    the bounds closed (on the event loop; the tests read the counts)."""

    def __init__(self, max_connections: int, header_timeout_s: float):
        assert max_connections >= 1 and header_timeout_s > 0
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.open: set[BoundedH11Protocol] = set()
        self.idle: OrderedDict[BoundedH11Protocol, None] = OrderedDict()
        self.n_timed_out = 0  # closed: no complete request head in time
        self.n_evicted = 0  # closed to make room for a new connection
        self.n_refused = 0  # answered 503: every connection was busy

    def protocol(self) -> type[H11Protocol]:
        """The protocol class for `uvicorn.Config(http=...)`, bound to these connections."""
        return type("StrataH11Protocol", (BoundedH11Protocol,), {"bounds": self})

    def make_room(self) -> bool:
        """Close the connection idle longest; False when none is idle."""
        while self.idle:
            oldest, _ = self.idle.popitem(last=False)
            if oldest.close("evicted"):
                return True
        return False


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline and a connection cap (`Connections`)."""

    bounds: Connections  # set on the subclass `Connections.protocol` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._seen: Any = None  # the request cycle whose head arrived last
        c = self.bounds
        c.open.add(self)
        if len(c.open) > c.max_connections and not c.make_room():
            c.n_refused += 1
            self._refuse()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may read a pipelined request's head
        if not self.transport.is_closing() and not self._check_head():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def timeout_keep_alive_handler(self) -> None:
        if not self._unread():
            super().timeout_keep_alive_handler()

    def close(self, why: str) -> bool:
        """Close this connection (a head too late, or room for another); False when it was
        closing already."""
        if why == "timed out" and self._unread():  # see `_unread`: look again shortly
            self._deadline = self.loop.call_later(0.5, self.close, why)
            return False
        self._forget()
        if self.transport.is_closing():
            return False
        if why == "timed out":
            self.bounds.n_timed_out += 1
        else:
            self.bounds.n_evicted += 1
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # mid-response: nothing more is said
            pass
        self.transport.close()
        return True

    # -- the head deadline ----------------------------------------------------------------------
    def _await_head(self) -> None:
        self._cancel()
        c = self.bounds
        c.idle[self] = None
        c.idle.move_to_end(self)
        self._deadline = self.loop.call_later(c.header_timeout_s, self.close, "timed out")

    def _check_head(self) -> bool:
        """Whether a request head arrived since the last look (then the deadline is off)."""
        if self.cycle is None or self.cycle is self._seen or self.cycle.response_complete:
            return False
        self._seen = self.cycle
        self._cancel()
        self.bounds.idle.pop(self, None)
        return True

    def _unread(self) -> bool:
        """Whether bytes wait in the socket that the event loop has not read: a loop held up
        (a long tokenization holding the GIL) runs a timer that fell due meanwhile before it
        reads them, and closing then would reset a request that came in time."""
        sock = self.transport.get_extra_info("socket")
        if sock is None or self.transport.is_closing():
            return False
        try:
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as peek:
                return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing waiting (EAGAIN), or no descriptor left to look with
            return False

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _forget(self) -> None:
        self._cancel()
        self.bounds.open.discard(self)
        self.bounds.idle.pop(self, None)

    def _refuse(self) -> None:
        self._forget()
        body = json.dumps({"error": {
            "message": f"the server holds {self.bounds.max_connections} connections, each "
                       "with a request in progress; retry shortly (strata serve "
                       "--max-connections)",
            "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
        self.transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body))
        self.transport.close()
