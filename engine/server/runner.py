"""ServerThread: uvicorn serving a Service's application in a thread with its own event loop,
on a socket bound first (a taken port is one line, before any model is loaded). `strata
serve` and the tests start and stop the server the same way.

Connections are bounded (`connections`: a head deadline, a cap below the file-descriptor
limit) and so is the log: a message that repeats (a flood of bad requests, a failing accept)
is written once per `LOG_WINDOW_S` with a count of those left out, never once per connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from engine.errors import StrataError
from engine.server.connections import Connections, connection_cap, raise_fd_limit
from engine.server.routes import build_app
from engine.server.service import Service
from engine.server.worker import LOG_NAME

STOP_TIMEOUT_S = 60.0
LOG_WINDOW_S = 10.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0: any free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StrataError(f"--host {host}: {exc.strerror}; give an address such as 127.0.0.1")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise StrataError(f"--host {host} --port {port}: {exc.strerror}; choose another port "
                          "(--port 0 takes any free one)") from None
    return sock


class ServerThread:
    """The HTTP server of one Service, running until `stop()`."""

    def __init__(self, service: Service, host: str, port: int):
        self.service = service
        config = service.config
        self.fd_limit = raise_fd_limit()
        self.connections = Connections(connection_cap(config.max_connections, self.fd_limit),
                                       config.header_timeout_s)
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        uv_config = uvicorn.Config(
            build_app(service), lifespan="off", log_config=None, log_level="warning",
            access_log=False, ws="none", timeout_graceful_shutdown=5,
            http=self.connections.protocol(), timeout_keep_alive=config.idle_timeout_s,
        )  # fmt: skip
        self.server = uvicorn.Server(uv_config)
        self.aio = asyncio.new_event_loop()
        self.aio.set_exception_handler(_loop_error)
        throttle_logs()
        self._thread = threading.Thread(target=self._run, name="strata-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        """Serve in the background; returns once connections are accepted."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise StrataError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Admit nothing more, cancel the running request (it rolls back), end the event
        streams, close the connections, and wait until the engine thread is idle."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.service.stop(), self.aio).result(STOP_TIMEOUT_S)
            self.server.should_exit = True
            self._thread.join(STOP_TIMEOUT_S)
        self.sock.close()
        if self.service.worker is not None:
            self.service.worker.close()

    @property
    def capped(self) -> bool:
        """Whether the file-descriptor limit cut --max-connections."""
        return self.connections.max_connections < self.service.config.max_connections

    def _run(self) -> None:
        asyncio.set_event_loop(self.aio)
        try:
            self.aio.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:
            self.aio.close()


class Throttle(logging.Filter):
    """Lets a message through once per `window_s` for each logger and message template; the
    next one after a quiet spell says how many were left out."""

    def __init__(self, window_s: float = LOG_WINDOW_S):
        super().__init__()
        self.window_s = window_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (shown at, left out)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            shown, n_left = self._last.get(key, (-self.window_s, 0))
            if now - shown < self.window_s:
                self._last[key] = (shown, n_left + 1)
                return False
            self._last[key] = (now, 0)
        if n_left:
            record.msg = f"{record.msg} ({n_left:,} more like this left out)"
        return True


_THROTTLE = Throttle()


def throttle_logs() -> None:
    """Throttle the loggers a client can make write: uvicorn's, asyncio's and the server's."""
    for name in ("uvicorn.error", "asyncio", LOG_NAME):
        logger = logging.getLogger(name)
        if _THROTTLE not in logger.filters:
            logger.addFilter(_THROTTLE)


def _loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An error the event loop reports (a failing accept, a transport's): one throttled line
    naming it, without a traceback (these are the system's conditions, not our bugs)."""
    exc = context.get("exception")
    why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    logging.getLogger("asyncio").error("%s%s", context.get("message", "event loop error"), why)
