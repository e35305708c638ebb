"""Service: what the endpoints share — the config, the event feed, the metrics, admission,
and (once the model is loaded) the engine worker — with the server's states: loading, ok,
stopping, and failed (the engine's check after a request did not hold).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from engine.request.conversation import PROMPT_BYTES_PER_TOKEN
from engine.runtime.serve import ServeLoop
from engine.server.config import ServerConfig
from engine.server.feed import EventFeed
from engine.server.metrics import Metrics
from engine.server.queue import Admission
from engine.server.schema import ChatRequest, RequestError
from engine.server.worker import EngineWorker, Job
from engine.trace.events import EventBus

T = TypeVar("T")
N_QUESTIONS = 1  # questions (tokenize, forecast) tokenizing at once beside the engine thread


class Service:
    """Built before the model loads (the server answers 503 'loading' meanwhile)."""

    def __init__(self, config: ServerConfig, bus: EventBus):
        self.config, self.bus = config, bus
        self.feed = EventFeed(bus)
        self.metrics = Metrics(bus)
        self.admission = Admission(config.queue_max)
        self.metrics.watch_queue(lambda: len(self.admission.waiting),
                                 lambda: int(self.admission.running is not None))
        self.worker: EngineWorker | None = None
        self.stopping = False
        self.created = int(time.time())  # /v1/models' `created`
        self._jobs: set[Job] = set()
        self._questions: anyio.CapacityLimiter | None = None  # made on the event loop

    def attach(self, loop: ServeLoop, on_line: Callable[[str], None] | None = None) -> None:
        """The model is loaded: requests run on it from now on."""
        self.worker = EngineWorker(loop, on_line,
                                   lambda outcome: self.metrics.requests.labels(outcome).inc())

    @property
    def status(self) -> str:
        if self.stopping:
            return "stopping"
        if self.worker is None:
            return "loading"
        return "error" if self.worker.fault else "ok"

    # -- checks the endpoints make ----------------------------------------------------------------
    def ready_worker(self) -> EngineWorker:
        """The worker, or a 503 saying why requests cannot run now."""
        if self.stopping:
            raise self.stopping_error()
        if self.worker is None:
            raise RequestError("the model is still loading; retry shortly", status=503,
                               kind="server_error", code="loading", headers={"Retry-After": "1"})
        if self.worker.fault:
            raise RequestError(self.worker.fault, status=503, kind="server_error",
                               code="engine_fault")
        return self.worker

    def stopping_error(self) -> RequestError:
        return RequestError("the server is shutting down", status=503, kind="server_error",
                            code="shutting_down")

    def model_names(self) -> set[str]:
        """What a request may call the model: its id, and the --model it was started with."""
        names = {self.config.model_id}
        if self.worker is not None:
            model = self.worker.loop.options.model
            names |= {model, Path(model).name, Path(model).stem}
        return names

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names():
            raise RequestError(f"model {model!r} is not served here; this server has "
                               f"{self.config.model_id!r} (GET /v1/models)", "model",
                               status=404, code="model_not_found")

    def check_prompt(self, n_bytes: int) -> None:
        """Refuse (413) messages whose text is past the prompt cap, before any work."""
        ctx = self.ready_worker().loop.options.ctx
        limit = self.config.prompt_limit(ctx)
        if n_bytes > limit:
            basis = ("--max-prompt-kib" if self.config.max_prompt_bytes is not None else
                     f"{PROMPT_BYTES_PER_TOKEN} bytes a token of --ctx {ctx:,}; strata serve "
                     "--max-prompt-kib raises it")
            raise RequestError(f"messages: the text is {n_bytes:,} bytes; the limit is "
                               f"{limit:,} ({basis})", "messages", status=413,
                               code="prompt_too_large", headers={"Connection": "close"})

    async def read_body(self, request: Request) -> bytes:
        """The body, refused (413) past the size limit without reading the rest, and (408)
        when it does not arrive within --body-timeout."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(size, limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(f"the request body did not arrive within "
                               f"{self.config.body_timeout_s:g} s ({size:,} bytes came; "
                               "strata serve --body-timeout)", status=408,
                               code="body_timeout", headers={"Connection": "close"}) from None
        return b"".join(chunks)

    async def question(self, call: Callable[..., T], *args: Any) -> T:
        """Run a question that tokenizes (`/tokenize`, `/v1/forecast`) on a worker thread,
        `N_QUESTIONS` at a time beside the engine thread; with --queue already waiting, 429."""
        if self._questions is None:
            self._questions = anyio.CapacityLimiter(N_QUESTIONS)
        if self._questions.statistics().tasks_waiting >= self.config.queue_max:
            self.metrics.refused.labels("queue_full").inc()
            raise RequestError(f"the server is busy: {self.config.queue_max} questions wait "
                               "already; retry in 1 s", status=429, code="queue_full",
                               kind="rate_limit_error", headers={"Retry-After": "1"})
        return await anyio.to_thread.run_sync(call, *args, limiter=self._questions)

    # -- actions -----------------------------------------------------------------------------------
    def start(self, req: ChatRequest, fit: Callable[[int], int],
              on_done: Callable[[], None]) -> Job:
        """Run an admitted request on the engine thread (on the event loop); `fit` gives the
        tokens to generate for the prompt's length, or refuses it (`Job`)."""
        assert self.worker is not None

        def done() -> None:
            self._jobs.discard(job)
            on_done()

        job = Job(req, fit, done)
        self._jobs.add(job)
        self.worker.start(job)
        return job

    async def stop(self) -> None:
        """Admit nothing more, cancel what runs (it rolls back), end the event streams."""
        self.stopping = True
        self.admission.close()
        for job in list(self._jobs):
            job.cancel()
        for job in list(self._jobs):
            await job.finished.wait()
        self.feed.close()


def _too_large(n_bytes: int, limit: int) -> RequestError:
    return RequestError(f"the request body is {n_bytes:,} bytes or more; the limit is "
                        f"{limit:,} (strata serve --max-body-mib)", status=413,
                        code="body_too_large", headers={"Connection": "close"})

