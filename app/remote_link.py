"""RemoteLink: the app against a running `strata serve` (`strata chat --connect URL`).

The same door as the in-process link: the chat goes through `POST /v1/chat/completions`
(streamed; its text becomes the Token events the chat log draws), the dashboard and the loan
timeline through `GET /v1/events` (the server's engine, every client's requests), flag toggles
through `POST /v1/flags` (the server's guards answer). Network I/O runs in async workers on the
app's own event loop, so no frame waits on it; Esc closes the request's connection, which is
how the server learns to cancel it (its loan rolls back).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from textual.app import App

from app.draft import Draft
from app.engine_link import EngineLink
from engine.config import EngineOptions, LoanFlags
from engine.errors import FlagError, StrataError
from engine.loan.forecast import LoanVerdict
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import Reply, converse
from engine.server.codec import (
    event_from_json,
    flags_from_json,
    flags_json,
    options_from_json,
    verdict_from_json,
)
from engine.trace.events import Token
from engine.trace.timing import Timing

RETRY_S = 1.0  # between tries while the server loads, or after its event stream ends
SYNC_TIMEOUT_S = 3.0  # flags and token counts are asked on the UI thread: kept short


class RemoteError(Exception):
    """The server refused or failed a request; the message is its own."""


@dataclass
class RemoteEngine:
    """The app's view of the server's engine (the EngineHandle the app reads)."""

    flags: LoanFlags
    options: EngineOptions
    link: RemoteLink = field(repr=False)

    @property
    def busy(self) -> bool:
        return self.link.running


class RemoteLink(EngineLink):
    """An EngineLink whose engine is a `strata serve` at `url`."""

    def __init__(self, app: App, url: str, api_key: str | None = None):
        super().__init__(app)
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.loop: RemoteEngine | None = None
        self.running = False
        self._client: httpx.AsyncClient | None = None
        self._cancel: asyncio.Event | None = None

    # -- UI thread ---------------------------------------------------------------------------
    def _begin(self) -> None:
        self._client = httpx.AsyncClient(base_url=self.url, headers=self.headers,
                                         timeout=httpx.Timeout(30.0, read=None))
        self.app.run_worker(self._connect(), group="engine", name="connect")

    def send(
        self,
        conv: Conversation,
        prompt: str,
        draft: Draft,
        params: SamplingParams,
        max_new: int,
    ) -> None:
        assert self.loop is not None, "send before the server answered"
        self.running = True
        self._cancel = asyncio.Event()
        self.app.run_worker(self._chat(conv, prompt, draft, params, max_new, self._cancel),
                            group="engine", name="chat")

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def set_flags(self, flags: LoanFlags, options: EngineOptions) -> list[str]:
        assert self.loop is not None
        now = self.loop.options
        changes = {k: v for k, v in vars(options).items() if getattr(now, k) != v}
        try:
            r = httpx.post(f"{self.url}/v1/flags", headers=self.headers, timeout=SYNC_TIMEOUT_S,
                           json={"flags": flags_json(flags), "options": changes})
        except httpx.HTTPError as exc:
            return [f"the server at {self.url} did not answer: {exc}"]
        body = _json(r)
        if r.status_code == 422:
            return list(body["error"]["violations"])
        if r.status_code != 200:
            return [_error_text(r.status_code, body)]
        self.loop.flags = flags_from_json(body["flags"])
        self.loop.options = options_from_json(body["options"])
        return []

    def count_tokens(self, text: str) -> int | None:
        """The server's count (None when it does not answer at once)."""
        try:
            r = httpx.post(f"{self.url}/tokenize", headers=self.headers, timeout=SYNC_TIMEOUT_S,
                           json={"content": text})
        except httpx.HTTPError:
            return None
        return len(_json(r).get("tokens", ())) if r.status_code == 200 else None

    def preview(self, conv: Conversation, text: str) -> LoanVerdict | None:
        """The server's verdict on sending `text` after `conv` (`POST /v1/forecast`); None
        when it does not answer at once."""
        messages = [*conv.as_dicts(), {"role": "user", "content": text}]
        try:
            r = httpx.post(f"{self.url}/v1/forecast", headers=self.headers,
                           timeout=SYNC_TIMEOUT_S, json={"messages": messages})
        except httpx.HTTPError:
            return None
        return verdict_from_json(_json(r)) if r.status_code == 200 else None

    def what_if(self, flags: LoanFlags, options: EngineOptions, n_fresh: int) -> LoanVerdict:
        """The server's what-if (`POST /v1/forecast` with the changed flags and options): its
        guards' refusal is a FlagError, a server that does not answer a StrataError."""
        assert self.loop is not None
        now = self.loop.options
        changes = {k: v for k, v in vars(options).items() if getattr(now, k) != v}
        try:
            r = httpx.post(f"{self.url}/v1/forecast", headers=self.headers,
                           timeout=SYNC_TIMEOUT_S, json={"fresh_tokens": n_fresh,
                                                         "flags": flags_json(flags),
                                                         "options": changes})
        except httpx.HTTPError as exc:
            raise StrataError(f"the server at {self.url} did not answer: {exc}") from None
        body = _json(r)
        if r.status_code == 422:
            raise FlagError(list(body["error"]["violations"]))
        if r.status_code != 200:
            raise StrataError(_error_text(r.status_code, body))
        return verdict_from_json(body)

    def close(self) -> None:
        self.cancel()

    # -- async workers on the app's loop -------------------------------------------------------
    async def _connect(self) -> None:
        """Follow the server's events; then ask for its flags (waiting while it loads)."""
        assert self._client is not None
        self.app.run_worker(self._follow_events(), group="engine-events", name="events")
        while True:
            try:
                r = await self._client.get("/v1/flags")
            except httpx.HTTPError as exc:
                self.app.post_message(self.LoadFailed(
                    f"cannot reach {self.url}: {exc or type(exc).__name__}; start "
                    "`strata serve` there first, or check --connect"))
                return
            body = _json(r)
            if r.status_code == 503 and body.get("error", {}).get("code") == "loading":
                await asyncio.sleep(RETRY_S)
                continue
            if r.status_code != 200:
                hint = ("; give strata chat --api-key KEY (or STRATA_API_KEY)"
                        if r.status_code == 401 else "")
                self.app.post_message(self.LoadFailed(
                    f"{self.url}: {_error_text(r.status_code, body)}{hint}"))
                return
            break
        self.loop = RemoteEngine(flags_from_json(body["flags"]),
                                 options_from_json(body["options"]), self)
        self.app.post_message(self.Loaded(self.loop))

    async def _follow_events(self) -> None:
        """The server's events (less tokens: this app's own come with its answer) into the
        queue; a dropped stream is followed again, starting with fresh snapshots."""
        assert self._client is not None
        while True:
            with contextlib.suppress(httpx.HTTPError):
                async with self._client.stream("GET", "/v1/events",
                                               params={"exclude": "Token"}) as r:
                    if r.status_code != 200:
                        await asyncio.sleep(RETRY_S)
                        continue
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            event = event_from_json(json.loads(line.removeprefix("data: ")))
                            if event is not None:
                                self._queue.append(event)
            await asyncio.sleep(RETRY_S)

    async def _chat(self, conv: Conversation, prompt: str, draft: Draft,
                    params: SamplingParams, max_new: int, cancel: asyncio.Event) -> None:
        messages = [*conv.as_dicts(), {"role": "user", "content": prompt}]
        try:
            reply = await self._complete(messages, params, max_new, cancel)
        except RemoteError as exc:
            self.running = False
            self.app.post_message(self.ReplyFailed(conv, str(exc), draft))
            return
        converse(conv, prompt, lambda: reply)  # the conversation keeps what the user saw
        self.running = False
        self.app.post_message(self.ReplyDone(conv, prompt, reply, draft))

    async def _complete(self, messages: list[dict[str, str]], params: SamplingParams,
                        max_new: int, cancel: asyncio.Event) -> Reply:
        """Stream one answer; a cancel closes the connection (the server rolls back) and
        returns the text so far, marked cancelled."""
        assert self._client is not None and self.loop is not None
        body = {
            "messages": messages, "max_tokens": max_new, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
        }  # fmt: skip
        pieces: list[str] = []
        end: dict[str, Any] = {}
        reader = asyncio.ensure_future(self._read(body, pieces, end))
        cancelled = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({reader, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            return Reply("".join(pieces), _timing(end), cancelled=True)
        reader.result()  # raises RemoteError
        return Reply("".join(pieces), _timing(end), finish_reason=end.get("finish", "stop"))

    async def _read(self, body: dict[str, Any], pieces: list[str], end: dict[str, Any]) -> None:
        assert self._client is not None
        try:
            async with self._client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RemoteError(_error_text(r.status_code, _json(r)))
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        raise RemoteError(chunk["error"]["message"])
                    for choice in chunk["choices"]:
                        text = choice["delta"].get("content")
                        if text:
                            pieces.append(text)
                            self._queue.append(Token(text))
                        if choice["finish_reason"]:
                            end["finish"] = choice["finish_reason"]
                    end.update({k: chunk[k] for k in ("usage", "timings") if chunk.get(k)})
        except httpx.HTTPError as exc:
            raise RemoteError(f"the server at {self.url} failed: {exc or type(exc).__name__}")


def _timing(end: dict[str, Any]) -> Timing:
    """The Timing of a remote answer, from its usage and llama.cpp-style timings."""
    u, t = end.get("usage", {}), end.get("timings", {})
    return Timing(
        prompt_tokens=u.get("prompt_tokens", 0),
        reused_tokens=u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        fresh_tokens=t.get("prompt_n", 0), prefill_s=t.get("prompt_ms", 0.0) / 1e3,
        generated=u.get("completion_tokens", 0), decode_s=t.get("predicted_ms", 0.0) / 1e3,
        drafts_offered=t.get("draft_n", 0), drafts_accepted=t.get("draft_n_accepted", 0),
    )  # fmt: skip


def _json(r: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object ({} when it is none: not a strata server at that URL)."""
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _error_text(status: int, body: Any) -> str:
    """The server's own message for an error answer."""
    try:
        return str(body["error"]["message"])
    except (KeyError, TypeError):
        return f"the server answered HTTP {status}"
