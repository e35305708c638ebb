"""`POST /v1/chat/completions`: validate, admit, run on the engine thread, answer as one JSON
object or as server-sent chunks (OpenAI's `chat.completion` / `chat.completion.chunk`).

What costs nothing to check is refused before the request takes a queue place (the body, its
fields, the model, the size of the messages' text against the prompt cap: 413); rendering and
tokenizing the prompt is work, so it waits its turn (or is refused 429 with the rest) and runs
on the engine thread, where a prompt longer than --ctx is refused before any answer starts. A
client that leaves while it waits gives its place up, and one that leaves while it runs
cancels it (the loan rolls back; the next request starts only when the engine is idle again).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.errors import StrataError
from engine.runtime.serve import Reply
from engine.server import sse
from engine.server.queue import Closed, QueueFull, Ticket
from engine.server.schema import ChatRequest, RequestError, parse_chat
from engine.server.service import Service
from engine.server.worker import Job
from engine.trace.events import PrefillProgress
from engine.trace.timing import Timing


async def chat_completions(request: Request) -> Completion:
    service: Service = request.app.state.service
    worker = service.ready_worker()
    req = parse_chat(await service.read_body(request), service.config.params)
    service.check_model(req.model)
    service.check_prompt(req.text_bytes)
    try:
        ticket = service.admission.enter()
    except QueueFull as exc:
        service.metrics.refused.labels("queue_full").inc()
        raise RequestError(str(exc), status=429, code="queue_full", kind="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
    except Closed:
        raise service.stopping_error() from None

    def fit(n_prompt: int) -> int:  # the engine thread, when the request's turn has come
        return fit_max_tokens(req, n_prompt, worker.loop.options.ctx, service.config.max_new)

    return Completion(service, req, fit, ticket)


def fit_max_tokens(req: ChatRequest, n_prompt: int, ctx: int, default: int) -> int:
    """The tokens to generate: `max_tokens`, or the server's default cut to what the context
    holds; a request whose prompt and answer cannot fit in --ctx is refused (as OpenAI does)."""
    if n_prompt >= ctx:
        raise RequestError(
            f"messages: the prompt is {n_prompt:,} tokens and --ctx is {ctx:,}, so no token is "
            "left to generate; shorten the messages or restart strata serve with a larger --ctx",
            "messages", code="context_length_exceeded")
    room = ctx - n_prompt
    if req.max_tokens is None:
        return min(default, room)
    if req.max_tokens > room:
        raise RequestError(
            f"max_tokens {req.max_tokens:,} with a {n_prompt:,}-token prompt exceeds --ctx "
            f"{ctx:,}: at most {room:,} tokens fit; lower max_tokens or leave it out",
            "max_tokens", code="context_length_exceeded")
    return req.max_tokens


def usage(t: Timing) -> dict[str, Any]:
    """OpenAI's usage: prompt, cached (reused from the KV cache) and completion tokens."""
    return {
        "prompt_tokens": t.prompt_tokens, "completion_tokens": t.generated,
        "total_tokens": t.prompt_tokens + t.generated,
        "prompt_tokens_details": {"cached_tokens": t.reused_tokens},
    }  # fmt: skip


def timings(t: Timing) -> dict[str, Any]:
    """llama.cpp's `timings` object: the engine's own PP and TG, and the drafts."""
    return {
        "cache_n": t.reused_tokens, "prompt_n": t.fresh_tokens, "prompt_ms": t.prefill_s * 1e3,
        "prompt_per_second": t.pp_tok_s, "predicted_n": t.generated,
        "predicted_ms": t.decode_s * 1e3, "predicted_per_second": t.tg_tok_s,
        "draft_n": t.drafts_offered, "draft_n_accepted": t.drafts_accepted,
    }  # fmt: skip


class Completion:
    """The ASGI response of one admitted request: waits for its turn, runs, answers."""

    def __init__(self, service: Service, req: ChatRequest, fit: Callable[[int], int],
                 ticket: Ticket):
        self.service, self.req, self.fit, self.ticket = service, req, fit, ticket
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    async def __call__(self, scope: dict[str, Any], receive: sse.Receive, send: sse.Send) -> None:
        gone: asyncio.Future[None] = asyncio.ensure_future(sse.disconnected(receive))
        try:
            try:
                ok, _ = await sse.first(self.ticket.turn(), gone)
            except Closed:
                await self._error(scope, receive, send, self.service.stopping_error())
                return
            if not ok:  # the client left while waiting: its place goes to the next one
                self.ticket.leave()
                return
            job = self.service.start(self.req, self.fit, on_done=self.ticket.leave)
            try:
                ok, _ = await sse.first(job.accepted.wait(), gone)  # the prompt is tokenized
                if not ok:
                    return
                failure = self._failure(job) if job.finished.is_set() else None
                if failure is not None:  # refused (too long for --ctx) or failed: no answer
                    await self._error(scope, receive, send, failure)
                    return
                if self.req.stream:
                    await self._stream(job, send, gone)
                else:
                    await self._whole(job, scope, receive, send, gone)
            finally:
                if not job.finished.is_set():  # the client left: roll the request back
                    job.cancel()
        finally:
            gone.cancel()

    # -- one JSON object -----------------------------------------------------------------------
    async def _whole(self, job: Job, scope: dict[str, Any], receive: sse.Receive,
                     send: sse.Send, gone: asyncio.Future[None]) -> None:
        ok, _ = await sse.first(job.finished.wait(), gone)
        if not ok:
            return
        failure = self._failure(job)
        if failure is not None:
            await self._error(scope, receive, send, failure)
            return
        reply = job.reply
        assert reply is not None
        body = {
            **self._head("chat.completion"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                         "logprobs": None, "finish_reason": reply.finish_reason}],
            "usage": usage(reply.timing), "timings": timings(reply.timing),
        }  # fmt: skip
        await JSONResponse(body)(scope, receive, send)

    # -- server-sent chunks --------------------------------------------------------------------
    async def _stream(self, job: Job, send: sse.Send, gone: asyncio.Future[None]) -> None:
        await sse.start(send)
        await sse.body(send, sse.data(self._chunk({"role": "assistant", "content": ""})))
        quiet_s = 0.0
        while not job.finished.is_set():
            await sse.first(job.finished.wait(), gone, timeout_s=1 / sse.FLUSH_HZ)
            if gone.done():
                return
            quiet_s = 0.0 if await self._flush(job, send) else quiet_s + 1 / sse.FLUSH_HZ
            if quiet_s >= sse.KEEPALIVE_S:
                await sse.body(send, sse.comment("keep-alive"))
                quiet_s = 0.0
        await self._flush(job, send)  # what came before `finished` was seen
        failure = self._failure(job)
        if failure is not None:
            await sse.body(send, sse.data(failure.body()))
        else:
            reply = job.reply
            assert reply is not None
            await sse.body(send, sse.data(self._chunk({}, reply.finish_reason, reply)))
            if self.req.include_usage:
                await sse.body(send, sse.data({**self._head("chat.completion.chunk"),
                                               "choices": [], "usage": usage(reply.timing)}))
        await sse.body(send, sse.DONE, more=False)

    async def _flush(self, job: Job, send: sse.Send) -> bool:
        """Send the text the engine wrote since the last flush as one chunk (or, while the
        prompt is read, a comment with its progress: clients skip it). Whether it sent."""
        items = job.take()
        text = "".join(i for i in items if isinstance(i, str))
        progress = [i for i in items if isinstance(i, PrefillProgress)]
        if text:
            await sse.body(send, sse.data(self._chunk({"content": text})))
        elif progress:
            p = progress[-1]
            await sse.body(send, sse.comment(f"prefill {p.tokens_done}/{p.tokens_total}"))
        return bool(text or progress)

    def _chunk(self, delta: dict[str, str], finish: str | None = None,
               reply: Reply | None = None) -> dict[str, Any]:
        out = {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if reply is not None:
            out["timings"] = timings(reply.timing)
        return out

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.service.config.model_id, "system_fingerprint": None}

    def _failure(self, job: Job) -> RequestError | None:
        """Why a finished request has no answer: its prompt was refused (4xx), the engine
        failed (500; a typed error's one line, else only where to look), or the server stopped
        and cancelled it (503)."""
        if isinstance(job.error, RequestError):
            self.service.metrics.refused.labels("invalid").inc()
            return job.error
        if job.error is not None:
            why = (f": {job.error}" if isinstance(job.error, StrataError)
                   else " (an internal error; the server's log has the details)")
            return RequestError(f"the engine failed and rolled the request back{why}",
                                status=500, kind="server_error", code="engine_error")
        assert job.reply is not None
        if job.reply.cancelled:
            return self.service.stopping_error()
        return None

    async def _error(self, scope: dict[str, Any], receive: sse.Receive, send: sse.Send,
                     err: RequestError) -> None:
        await JSONResponse(err.body(), err.status, err.headers)(scope, receive, send)


