"""The server on CUDA (gpu marker), the loan on: the engine is built on one thread and serves on
another (the engine thread), the streamed text is `strata run`'s, and a client killed
mid-decode leaves the ledger and the device memory as before the request.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_server_gpu.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from gates import Gate
from servers import fresh_answer, run_argv, running, strata
from test_gpu_engine import LOAN, mid_path  # noqa: F401 - the fixture, and skips without a GPU

from engine.trace.events import RequestDone, Token

pytestmark = pytest.mark.gpu
OPTIONS = {"device": "cuda", "ctx": 4096, "serve": True, "vram_elastic": True, "mtp": True,
           "spec": 2, "vram_limit": "4GiB", "vram_segment_mib": 64}
PROMPT = "the river runs through the old city " * 40  # ~320 fresh tokens: a repeat loan


def test_the_server_on_cuda_answers_as_strata_run_and_rolls_back(mid_path: Path) -> None:  # noqa: F811
    model = str(mid_path)
    with running(model, OPTIONS, LOAN) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
            temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        out = strata("run", "--model", model, "--prompt", PROMPT, "--max-new", "16",
                     *run_argv(OPTIONS), env=LOAN.as_env())
        assert out.returncode == 0, out.stderr
        assert text == out.stdout.removesuffix("\n")

        before = server.vram()
        seen: list[object] = []
        server.bus.subscribe(seen.append)
        tokens = iter(range(10**6))
        gate = Gate(server.bus, lambda e: isinstance(e, Token) and next(tokens) == 3)
        body = {"messages": [{"role": "user", "content": PROMPT + " again"}], "max_tokens": 64,
                "stream": True}
        with httpx.Client(base_url=server.url, timeout=120) as c, \
                c.stream("POST", "/v1/chat/completions", json=body):
            assert gate.reached.wait(60)
        job = next(iter(server.service._jobs))
        deadline = time.monotonic() + 30
        while not job.cancel_event.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gate.release()
        while server.service._jobs:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        done = [e for e in seen if isinstance(e, RequestDone)]
        assert done[-1].cancelled and server.vram() == before
        server.loop.rt.check_integrity()
        with httpx.Client(base_url=server.url, timeout=120) as c:
            r = c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 16})
        again = json.loads(r.text)["choices"][0]["message"]["content"]
    assert again == fresh_answer(model, PROMPT + " again", 16, OPTIONS)
