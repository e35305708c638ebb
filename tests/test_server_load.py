"""The server under load and under clients that go away: fifty concurrent clients on
loopback (a complete answer or a 429, none lost or mixed, the ledger as before), a client
killed mid-prefill and mid-decode (the loan rolled back, the next answer a fresh engine's),
and a server stopped mid-request."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gates import Gate
from servers import Running, fresh_answer, running

from engine.trace.events import Event, LoanStep, PrefillProgress, RequestDone, Token

PROMPTS = ["house", "What is a cat?", "What does 'water' mean?", "Synonyms of big?",
           "What is the opposite of 'hot'?"]
MAX_NEW = 12
LONG = "the river runs through the old city and the ships come in " * 60  # ~720 tokens
N_CLIENTS = 50


@pytest.fixture(scope="module")
def server(demo_path: Path) -> Iterator[Running]:
    with running(str(demo_path), queue_max=3) as r:
        with r.client() as c:  # the startup loan is over: every region resident from now on
            assert c.post("/v1/chat/completions", json=_body("house", 4)).status_code == 200
        yield r


def _body(prompt: str, max_tokens: int = MAX_NEW, stream: bool = False) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": stream}


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _idle(server: Running) -> None:
    _wait(lambda: server.service.admission.running is None and not server.service._jobs,
          "the engine to be idle")


def _events(server: Running) -> list[Event]:
    seen: list[Event] = []
    server.bus.subscribe(seen.append)
    return seen


def _stream_text(lines: list[str]) -> str:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line.removeprefix("data: "))["choices"]
            out += [c["delta"].get("content") or "" for c in choices]
    return "".join(out)


def test_fifty_concurrent_clients_get_an_answer_or_a_429(server: Running, demo_path: Path) -> None:
    expected = {p: fresh_answer(str(demo_path), p, MAX_NEW) for p in PROMPTS}
    before = server.vram()
    done_before = server.service.worker.outcomes["completed"]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, int, str, dict]:
        prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 1
        if not stream:
            r = await c.post("/v1/chat/completions", json=_body(prompt))
            body = r.json()
            text = body["choices"][0]["message"]["content"] if r.status_code == 200 else ""
            return prompt, r.status_code, text, dict(r.headers)
        async with c.stream("POST", "/v1/chat/completions", json=_body(prompt, stream=True)) as r:
            lines = [line async for line in r.aiter_lines()]
            ok = r.status_code == 200 and lines[-2:] == ["data: [DONE]", ""]
            return prompt, r.status_code if ok or r.status_code != 200 else -1, _stream_text(
                lines), dict(r.headers)

    async def storm() -> list[tuple[str, int, str, dict]]:
        limits = httpx.Limits(max_connections=N_CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(N_CLIENTS)))

    results = asyncio.run(storm())
    answered = [(p, text) for p, status, text, _ in results if status == 200]
    refused = [h for _, status, _, h in results if status == 429]
    assert len(answered) + len(refused) == N_CLIENTS, [r[:2] for r in results]
    assert answered and refused  # the queue holds 3 behind the running one
    for prompt, text in answered:  # each its own prompt's answer, whole
        assert text == expected[prompt], (prompt, text)
    assert all(int(h["retry-after"]) >= 1 for h in refused)
    _idle(server)
    assert server.service.worker.outcomes["completed"] - done_before == len(answered)
    assert server.vram() == before  # the ledger and the cache as before the storm


def test_a_client_killed_mid_prefill_rolls_the_loan_back(server: Running, demo_path: Path) -> None:
    before = server.vram()
    seen = _events(server)
    gate = Gate(server.bus, lambda e: isinstance(e, PrefillProgress) and e.chunk < e.n_chunks)
    body = json.dumps(_body(LONG, 8)).encode()
    with socket.create_connection(_addr(server)) as sock:  # a bare client, killed below
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert gate.reached.wait(30), "the prefill never started"
    job = next(iter(server.service._jobs))
    _wait(job.cancel_event.is_set, "the server to notice the client left")
    gate.release()
    _idle(server)
    done = [e for e in seen if isinstance(e, RequestDone)]
    steps = [e.step for e in seen if isinstance(e, LoanStep)]
    assert done[-1].cancelled and done[-1].generated == 0
    assert steps[0] == "release" and steps[-1] == "cancelled"  # a repeat loan, rolled back
    assert server.vram() == before
    with server.client() as c:
        again = c.post("/v1/chat/completions", json=_body(LONG, 8)).json()
    assert again["choices"][0]["message"]["content"] == fresh_answer(str(demo_path), LONG, 8)


CLIENT = textwrap.dedent("""
    import sys, httpx
    body = {"model": "demo", "messages": [{"role": "user", "content": sys.argv[2]}],
            "max_tokens": 40, "stream": True}
    with httpx.stream("POST", sys.argv[1] + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content":"' in line:
                print("text", flush=True)
""")


def test_a_client_killed_mid_decode_is_cancelled(server: Running, demo_path: Path) -> None:
    before = server.vram()
    seen = _events(server)
    tokens = iter(range(10**6))
    gate = Gate(server.bus, lambda e: isinstance(e, Token) and next(tokens) == 3)
    prompt = "What does 'water' mean?"
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.url, prompt],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert gate.reached.wait(30), "the decode never reached its fourth token"
        assert client.stdout is not None and client.stdout.readline() == "text\n"
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    job = next(iter(server.service._jobs))
    _wait(job.cancel_event.is_set, "the server to notice the client was killed")
    gate.release()
    _idle(server)
    done = [e for e in seen if isinstance(e, RequestDone)]
    assert done[-1].cancelled and 4 <= done[-1].generated < 40
    assert server.vram() == before
    with server.client() as c:
        again = c.post("/v1/chat/completions", json=_body(prompt, 40)).json()
    assert again["choices"][0]["message"]["content"] == fresh_answer(str(demo_path), prompt, 40)


def test_a_waiting_client_that_leaves_gives_its_place_up(server: Running) -> None:
    gate = Gate(server.bus, lambda e: isinstance(e, Token))
    with httpx.Client(base_url=server.url, timeout=60) as c, \
            c.stream("POST", "/v1/chat/completions", json=_body("house", stream=True)) as first:
        assert gate.reached.wait(30)
        with socket.create_connection(_addr(server)) as sock:  # waits, then leaves
            body = json.dumps(_body("What is a cat?")).encode()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         b"%d\r\n\r\n%s" % (len(body), body))
            _wait(lambda: len(server.service.admission.waiting) == 1, "the second to wait")
        _wait(lambda: not server.service.admission.waiting, "the place to be given up")
        gate.release()
        assert _stream_text(list(first.iter_lines()))
    _idle(server)


def _addr(server: Running) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def test_stopping_the_server_mid_request_rolls_back(demo_path: Path) -> None:
    with running(str(demo_path)) as r:
        with r.client() as c:
            c.post("/v1/chat/completions", json=_body("house", 4))
        before = r.service.worker.idle_state()
        gate = Gate(r.bus, lambda e: isinstance(e, PrefillProgress) and e.chunk < e.n_chunks)
        lines: list[str] = []
        with httpx.Client(base_url=r.url, timeout=60) as c, \
                c.stream("POST", "/v1/chat/completions", json=_body(LONG, 8, True)) as s:
            assert gate.reached.wait(30)
            stopper = threading.Thread(target=r.server.stop)
            stopper.start()
            _wait(lambda: r.service.stopping, "the server to begin stopping")
            gate.release()
            lines = list(s.iter_lines())
            stopper.join(30)
        error = json.loads(next(x for x in lines if '"error"' in x).removeprefix("data: "))
        assert error["error"]["code"] == "shutting_down" and lines[-2] == "data: [DONE]"
        assert r.service.worker.outcomes["cancelled"] == 1
        assert r.service.worker.fault is None and r.service.worker.idle_state() == before
        r.loop.rt.check_integrity()
