"""Servers for the server tests: the real HTTP server (uvicorn in a thread, as `strata serve`
runs it) on a free loopback port, on a real engine, and the loan settings they share."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from engine.cli.options import options_argv
from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from engine.server.config import ServerConfig
from engine.server.runner import ServerThread
from engine.server.service import Service
from engine.trace.events import EventBus

# the loan on: the serve path, elastic segments, MTP drafts, every loan flag; small context
LOAN = {"serve": True, "vram_elastic": True, "mtp": True, "spec": 2, "ctx": 1024, "prefill": 256}
FLAGS = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                       retain_startup_chunk=True, repeat_loan=True, repeat_min_tokens=256)


@dataclass
class Running:
    """A server on a real engine: its URL, and the in-process parts a test may look at."""

    url: str
    service: Service
    loop: ServeLoop
    bus: EventBus
    server: ServerThread

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)  # type: ignore[arg-type]

    def vram(self) -> dict:
        """The ledger by region and the cache's slot counts (GET /v1/vram), states left out."""
        with self.client() as c:
            body = c.get("/v1/vram").json()
        cache = {k: v for k, v in body["expert_cache"].items() if k != "states"}
        return {"regions": body["ledger"]["regions"], "cache": cache}


@contextmanager
def running(model: str, options: dict | None = None, flags: LoanFlags = FLAGS,
            **config: object) -> Iterator[Running]:
    """Serve `model` on 127.0.0.1, any free port, until the block ends (then stop it)."""
    bus = EventBus()
    service = Service(ServerConfig(model_id="demo", port=0, **config), bus)  # type: ignore[arg-type]
    server = ServerThread(service, "127.0.0.1", 0).start()
    loop = None
    try:
        loop = ServeLoop.create(EngineOptions(model=model, **(options or LOAN)), flags, bus)
        service.attach(loop)
        yield Running(server.url, service, loop, bus, server)
    finally:
        server.stop()
        if loop is not None:
            loop.close()


def fresh_answer(model: str, prompt: str, max_new: int, options: dict | None = None,
                 params: SamplingParams | None = None) -> str:
    """What a fresh engine (same options and flags) answers to one user message."""
    loop = ServeLoop.create(EngineOptions(model=model, **(options or LOAN)), FLAGS)
    return loop.chat(Conversation(), prompt, params, max_new).text


def run_argv(options: dict) -> list[str]:
    """`strata run` options for EngineOptions fields."""
    return options_argv(EngineOptions(**options))


def strata(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`strata ARGV` in a fresh process (loan flags from `env`)."""
    return subprocess.run([sys.executable, "-m", "engine.cli", *argv], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120, check=False)
