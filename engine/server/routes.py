"""The Starlette application: every endpoint but the chat completion (`completions`), the
bearer-token check, and errors as OpenAI's JSON shape (never Starlette's plain text).

    GET  /health               ok, loading, stopping or error (no token needed)
    GET  /v1/models            the served model (also /v1/models/{id})
    POST /v1/chat/completions  see `completions`
    GET  /metrics              Prometheus text
    GET  /v1/vram              the ledger and the expert cache as JSON
    GET  /v1/flags             loan flags and engine options in force
    POST /v1/flags             change them through the guards (422 with every reason)
    GET  /v1/events            the engine's events as server-sent events
    POST /tokenize             {"content": text} -> {"tokens": [ids]} (llama.cpp's)
    POST /v1/forecast          the loan a message would get and the prefill's forecast:
                               {"messages": [...]} (the last the user's), or a what-if
                               {"fresh_tokens": n, "flags": {...}, "options": {...}}
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from engine.errors import FlagError, StrataError
from engine.request.sampler import SamplingParams
from engine.runtime import flags as runtime_flags
from engine.server import codec, sse
from engine.server.completions import chat_completions
from engine.server.feed import EventFeed
from engine.server.metrics import CONTENT_TYPE
from engine.server.origin import SameOrigin
from engine.server.schema import RequestError, parse_chat, parse_json
from engine.server.service import Service
from engine.server.worker import LOG_NAME, conversation
from engine.trace.events import CacheChanged, Event, LedgerChanged, Ready

PUBLIC_PATHS = ("/health",)
log = logging.getLogger(LOG_NAME)


def build_app(service: Service) -> Starlette:
    """The ASGI application of one Service."""
    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/models/{model_id:path}", model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/v1/vram", vram),
        Route("/v1/flags", flags, methods=["GET", "POST"]),
        Route("/v1/events", events),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/forecast", forecast, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(LastResort), Middleware(BearerAuth, api_key=service.config.api_key),
                    Middleware(SameOrigin, config=service.config)],
        exception_handlers={RequestError: _request_error, HTTPException: _http_error},
    )
    app.state.service = service
    return app


class BearerAuth:
    """ASGI middleware: with an API key, every path but /health wants `Authorization: Bearer
    KEY` (compared in constant time); without one, it passes everything through."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict[str, Any], receive: sse.Receive, send: sse.Send) -> None:
        if scope["type"] == "http" and self.api_key and scope["path"] not in PUBLIC_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                why = "no API key was given" if not header else "the API key is wrong"
                err = RequestError(f"{why}: send 'Authorization: Bearer KEY' with the key "
                                   "strata serve was started with", status=401,
                                   kind="authentication_error", code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})
                await _json_error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- errors --------------------------------------------------------------------------------------
def _json_error(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, err.headers)


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    if exc.status != 429 and 400 <= exc.status < 500:
        _service(request).metrics.refused.labels("invalid").inc()
    return _json_error(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no endpoint {request.url.path}; see GET /v1/models, POST /v1/chat/completions"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return _json_error(RequestError(message, status=exc.status_code, headers=exc.headers))


class LastResort:
    """ASGI middleware: an exception no handler answered (our bug) is a 500 JSON body that
    does not repeat its text (the server's log has it, with the traceback, once), and the
    connection stays usable. A client that left while its body was read needs no answer."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: sse.Receive, send: sse.Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except ClientDisconnect:
            pass
        except Exception:  # the last resort: answered, logged, not re-raised
            log.exception("internal error answering %s %s", scope["method"], scope["path"])
            if not started:  # past the start uvicorn closes the connection: nothing to say
                err = RequestError("internal error; the server's log has the details",
                                   status=500, kind="server_error", code="internal_error")
                await _json_error(err)(scope, receive, send)


def _service(request: Request) -> Service:
    return request.app.state.service


# -- endpoints ------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    s = _service(request)
    status = s.status
    body: dict[str, Any] = {"status": status, "model": s.config.model_id}
    if status == "ok":
        body |= {"busy": s.admission.running is not None, "waiting": len(s.admission.waiting)}
    if status == "error" and s.worker is not None:
        body["message"] = s.worker.fault
    return JSONResponse(body, 200 if status == "ok" else 503)


def _card(s: Service) -> dict[str, Any]:
    worker = s.ready_worker()
    ready = s.feed.latest(Ready)
    meta: dict[str, Any] = {"n_ctx": worker.loop.options.ctx}
    if isinstance(ready, Ready):
        meta |= {"name": ready.model_name, "description": ready.model_description,
                 "n_layer": ready.n_layer, "n_expert": ready.n_expert,
                 "n_expert_used": ready.n_expert_used, "n_vocab": ready.n_vocab,
                 "device": ready.device}
    return {"id": s.config.model_id, "object": "model", "created": s.created,
            "owned_by": "strata", "meta": meta}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_card(_service(request))]})


async def model(request: Request) -> Response:
    s = _service(request)
    name = request.path_params["model_id"]
    s.ready_worker()
    s.check_model(name)
    return JSONResponse(_card(s))


async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE)


async def vram(request: Request) -> Response:
    s = _service(request)
    ledger, cache = s.feed.latest(LedgerChanged), s.feed.latest(CacheChanged)
    assert ledger is None or isinstance(ledger, LedgerChanged)
    assert cache is None or isinstance(cache, CacheChanged)
    body = codec.vram_json(ledger, cache)
    body["busy"] = s.admission.running is not None
    return JSONResponse(body)


async def flags(request: Request) -> Response:
    s = _service(request)
    loop = s.ready_worker().loop
    said: list[str] = []  # an accepted change's warnings (a threshold clamped to 256)
    if request.method == "POST":
        body = parse_json(await s.read_body(request))
        try:
            new_flags, new_options = codec.changed(loop.flags, loop.options, body)
        except codec.ChangeError as exc:
            raise RequestError(str(exc), exc.param) from None
        except FlagError as exc:
            return _refused(exc.violations)
        violations = await anyio.to_thread.run_sync(loop.set_flags, new_flags, new_options)
        if violations:
            return _refused(violations)
        said = runtime_flags.warnings(new_options, new_flags)
    return JSONResponse({"flags": codec.flags_json(loop.flags),
                         "options": codec.options_json(loop.options),
                         "applies": "from the next request", "warnings": said})


def _refused(violations: list[str]) -> Response:
    body = RequestError("; ".join(violations), "flags", status=422, code="flags_refused").body()
    body["error"]["violations"] = violations
    return JSONResponse(body, 422)


async def tokenize(request: Request) -> Response:
    s = _service(request)
    loop = s.ready_worker().loop
    content = parse_json(await s.read_body(request)).get("content")
    if not isinstance(content, str):
        raise RequestError("content must be a string: the text to tokenize", "content")
    s.check_prompt(len(content.encode()))
    ids = await s.question(lambda: loop.rt.model.tokenizer.encode(content, special=False))
    return JSONResponse({"tokens": ids})


async def forecast(request: Request) -> Response:
    """The engine's verdict on a message, as the app's composer asks it in process
    (`ServeLoop.preview`: the request's messages as a chat request would send them), or on
    an `n`-token message under flags and options not applied (`ServeLoop.what_if`; refused
    ones are a 422 with every reason, as `POST /v1/flags`)."""
    s = _service(request)
    loop = s.ready_worker().loop
    raw = await s.read_body(request)
    body = parse_json(raw)
    if "fresh_tokens" in body:
        n = body["fresh_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RequestError("fresh_tokens must be a token count >= 1", "fresh_tokens")
        change = {k: v for k, v in body.items() if k != "fresh_tokens"}
        try:
            new_flags, new_options = codec.changed(loop.flags, loop.options, change)
            verdict = await anyio.to_thread.run_sync(loop.what_if, new_flags, new_options, n)
        except codec.ChangeError as exc:
            raise RequestError(str(exc), exc.param) from None
        except FlagError as exc:
            return _refused(exc.violations)
        return JSONResponse(codec.verdict_json(verdict))
    chat = parse_chat(raw, SamplingParams())  # the messages a chat completion would send
    s.check_prompt(chat.text_bytes)
    try:
        verdict = await s.question(loop.preview, conversation(chat), chat.prompt)
    except RequestError:
        raise
    except StrataError as exc:  # the chat template refused the messages
        raise RequestError(f"messages: {exc}", "messages") from None
    return JSONResponse(codec.verdict_json(verdict))


async def events(request: Request) -> Response:
    names = {}
    for key in ("types", "exclude"):
        listed = [n for n in request.query_params.get(key, "").split(",") if n]
        unknown = [n for n in listed if n not in codec.EVENT_TYPES]
        if unknown:
            raise RequestError(f"{key}: {unknown[0]!r} is not an event type; one of "
                               f"{', '.join(codec.EVENT_TYPES)}", key)
        names[key] = frozenset(listed)
    only, exclude = names["types"], names["exclude"]

    def wants(e: Event) -> bool:
        name = type(e).__name__
        return (not only or name in only) and name not in exclude

    return EventStream(_service(request).feed, wants)  # type: ignore[return-value]


class EventStream:
    """`GET /v1/events`: the latest snapshots, then every event as it is published, until the
    client leaves or the server stops."""

    def __init__(self, feed: EventFeed, wants: Any):
        self.feed, self.wants = feed, wants

    async def __call__(self, scope: dict[str, Any], receive: sse.Receive, send: sse.Send) -> None:
        sub = self.feed.subscribe(self.wants)
        gone: asyncio.Future[None] = asyncio.ensure_future(sse.disconnected(receive))
        try:
            await sse.start(send)
            quiet_s = 0.0
            while True:
                ended = sub.ended  # read before taking: what came before the end is sent
                events = sub.take()
                if events:
                    await sse.body(send, b"".join(
                        sse.data(codec.event_json(e), type(e).__name__) for e in events))
                    quiet_s = 0.0
                elif ended:  # the server stops, or this client fell too far behind
                    await sse.body(send, b"", more=False)
                    return
                elif quiet_s >= sse.KEEPALIVE_S:
                    await sse.body(send, sse.comment("keep-alive"))
                    quiet_s = 0.0
                await asyncio.wait({gone}, timeout=1 / sse.FLUSH_HZ)
                if gone.done():
                    return
                quiet_s += 1 / sse.FLUSH_HZ
        finally:
            gone.cancel()
            self.feed.unsubscribe(sub)
