"""ServerThread: uvicorn serving a Service's application in a thread with its own event loop,
on a socket bound first (a taken port is one line, before any model is loaded). `strata
serve` and the tests start and stop the server the same way.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from engine.errors import StrataError
from engine.server.routes import build_app
from engine.server.service import Service

STOP_TIMEOUT_S = 60.0


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
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            build_app(service), lifespan="off", log_config=None, log_level="warning",
            access_log=False, ws="none", timeout_graceful_shutdown=5,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.aio = asyncio.new_event_loop()
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

    def _run(self) -> None:
        asyncio.set_event_loop(self.aio)
        try:
            self.aio.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:
            self.aio.close()
