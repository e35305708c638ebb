"""What a web page may make a server without an API key do: nothing it could not do itself.

A browser lets any page send a "simple" cross-site POST (text/plain or form-encoded, no
preflight), and a page whose own name resolves to this machine (DNS rebinding) reaches a
loopback server as same-origin. Without a key, `SameOrigin` therefore refuses:

- a Host header that is not one of this server's names (loopback names, the --host it listens
  on, --allow-host names): 421, which defeats DNS rebinding;
- a write (any method but GET, HEAD, OPTIONS) with an Origin other than the server's own
  (`Origin: null` included): 403;
- a POST whose Content-Type is not application/json: 415 (a form or text/plain body is what
  a page can send without asking; JSON needs a preflight, which gets no CORS headers here).

No CORS headers are ever sent, so a page elsewhere cannot read an answer either. With an API
key every path but /health needs it, and a page does not have it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from engine.server import sse
from engine.server.config import ServerConfig
from engine.server.schema import RequestError

READS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON_TYPE = "application/json"


def host_name(host: str) -> str:
    """The name in a Host header (or an Origin's netloc): without the port or IPv6 brackets."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


def refusal(config: ServerConfig, method: str, headers: dict[bytes, bytes]) -> RequestError | None:
    """Why a request to a server without a key is refused (None: it is not)."""
    host = headers.get(b"host", b"").decode("latin-1").strip()
    if not config.host_allowed(host_name(host)):
        shown = repr(host[:80]) if host else "missing"
        return RequestError(
            f"the Host header is {shown}; this server answers to {config.host} and loopback "
            "names (a page from elsewhere may not reach it); start strata serve with "
            "--allow-host NAME or --api-key to allow other names", "Host", status=421,
            code="host_not_allowed")
    if method in READS:
        return None
    origin = headers.get(b"origin")
    if origin is not None:
        parts = urlsplit(origin.decode("latin-1").strip())
        if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
            return RequestError(
                f"a {method} from the web page at {origin.decode('latin-1')[:80]!r} is refused: "
                "without an API key only this server's own pages and clients that send no "
                "Origin (curl, SDKs) may write; start strata serve with --api-key to allow "
                "it", "Origin", status=403, code="cross_origin")
    if method == "POST":
        media = headers.get(b"content-type", b"").decode("latin-1").partition(";")[0]
        if media.strip().lower() != JSON_TYPE:
            shown = repr(media.strip()[:60]) if media.strip() else "missing"
            return RequestError(
                f"the Content-Type is {shown}; send the body as JSON with 'Content-Type: "
                f"{JSON_TYPE}'", "Content-Type", status=415, code="unsupported_media_type")
    return None


class SameOrigin:
    """ASGI middleware: without an API key, `refusal`'s requests get its 4xx JSON body; with
    one it passes everything through (the key check stands in for it)."""

    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope: dict[str, Any], receive: sse.Receive, send: sse.Send) -> None:
        if scope["type"] == "http" and not self.config.api_key:
            err = refusal(self.config, scope["method"], dict(scope["headers"]))
            if err is not None:
                await JSONResponse(err.body(), err.status, err.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)
