"""The OpenAI-compatible server on the demo with the loan on: the real `openai` client, the
same text as `strata run`, usage, stop strings, flags, events, metrics, and bad requests (a
4xx naming what was wrong, never a 500)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from servers import FLAGS, LOAN, Running, run_argv, running, strata

from engine.request.conversation import Conversation
from engine.server.codec import event_from_json
from engine.trace.events import LoanStep, RequestDone

WATER = "What does 'water' mean?"
TIMING = re.compile(r"prompt (\d+) tokens = (\d+) reused.*?, (\d+) generated")


@pytest.fixture(scope="module")
def server(demo_path: Path) -> Iterator[Running]:
    with running(str(demo_path), max_body_bytes=64 * 1024) as r:
        yield r


@pytest.fixture(scope="module")
def client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def strata_run(demo_path: Path, prompt: str, *extra: str) -> tuple[str, tuple[int, ...]]:
    """`strata run`'s text (stdout less the newline it ends the text with) and its timing
    line's (prompt, reused, generated) token counts, with the server's options and flags."""
    out = strata("run", "--model", str(demo_path), "--prompt", prompt, *run_argv(LOAN), *extra,
                 env=FLAGS.as_env())
    assert out.returncode == 0, out.stderr
    counts = TIMING.search(out.stderr)
    assert counts is not None, out.stderr
    return out.stdout.removesuffix("\n"), tuple(int(c) for c in counts.groups())


def test_the_openai_client_streams_what_strata_run_writes(
    client: openai.OpenAI, demo_path: Path
) -> None:
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": WATER}], max_tokens=40,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    expected, (n_prompt, _, n_generated) = strata_run(demo_path, WATER, "--max-new", "40")
    assert text == expected and text.startswith("water (noun)")
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == n_prompt and usage.completion_tokens == n_generated == 40


def test_sampled_text_equals_strata_run_with_the_same_seed(
    client: openai.OpenAI, demo_path: Path
) -> None:
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "What is a cat?"}], max_tokens=24,
        temperature=0.9, top_p=0.9, seed=7)
    expected, _ = strata_run(demo_path, "What is a cat?", "--max-new", "24",
                             "--temperature", "0.9", "--top-p", "0.9", "--seed", "7")
    assert reply.choices[0].message.content == expected


def test_a_repeated_prompt_is_read_from_the_kv_cache(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "house"}]
    first = client.chat.completions.create(model="demo", messages=messages, max_tokens=8)
    again = client.chat.completions.create(model="demo", messages=messages, max_tokens=8)
    assert again.choices[0].message.content == first.choices[0].message.content
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1  # the last is recomputed
    assert again.usage.total_tokens == n + again.usage.completion_tokens


def test_stop_strings_end_the_answer_before_them(client: openai.OpenAI, demo_path: Path) -> None:
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": WATER}], max_tokens=40,
        stop=["compound", "zzz"])
    expected, _ = strata_run(demo_path, WATER, "--max-new", "40", "--stop", "compound",
                             "--stop", "zzz")
    assert reply.choices[0].message.content == expected == "water (noun): binary "
    assert reply.choices[0].finish_reason == "stop"


def test_models_health_and_the_model_card(client: openai.OpenAI, server: Running) -> None:
    (card,) = client.models.list().data
    assert card.id == "demo" and client.models.retrieve("demo").id == "demo"
    with server.client() as c:
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["busy"] is False
        meta = c.get("/v1/models").json()["data"][0]["meta"]
        assert meta["n_ctx"] == LOAN["ctx"] and meta["n_expert"] == 32


BAD = [  # (body, status, param, words in the message)
    (b'{"messages": [{"role": "user"', 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    (b"\xff\xfe", 400, None, "not UTF-8"),
    ({"model": "demo"}, 400, "messages", "messages is required"),
    ({"messages": []}, 400, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "'robot'"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "a number"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", "image_url part"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages", "the user's"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model",
     "'gpt-4o' is not served here"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens",
     "max_tokens 0 must be at least 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}, 400,
     "max_tokens", "exceeds --ctx 1,024"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, 400, "max_tokens",
     "must be an integer, not a string"),
    ({"messages": [{"role": "user", "content": "word " * 1200}]}, 400, "messages",
     "--ctx is 1,024"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature",
     "temperature 3 must be in [0, 2]"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": -1}, 400, "seed", "seed -1"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream",
     "true or false"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop", "at most 4"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", "one choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools", "tool calls are not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, 400,
     "presence_penalty", "penalties"),
    (b"x" * (65 * 1024), 413, None, "the limit is 65,536"),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), BAD)
def test_bad_requests_get_a_4xx_naming_what_is_wrong(
    server: Running, body: bytes | dict, status: int, param: str | None, words: str
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with server.client() as c:
        r = c.post("/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_unknown_paths_and_methods_answer_json(server: Running) -> None:
    with server.client() as c:
        r = c.get("/v1/completions")
        assert r.status_code == 404 and "no endpoint /v1/completions" in r.json()["error"]["message"]
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]


def test_the_openai_client_sees_an_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


def test_flags_change_through_the_guards(server: Running) -> None:
    with server.client() as c:
        now = c.get("/v1/flags").json()
        assert now["flags"]["elastic_loan"] is True and now["options"]["spec"] == 2
        r = c.post("/v1/flags", json={"flags": {"STRATA_PREFILL_REPEAT_MIN_TOKENS": 512}})
        assert r.status_code == 200 and r.json()["flags"]["repeat_min_tokens"] == 512
        assert server.loop.flags.repeat_min_tokens == 512
        r = c.post("/v1/flags", json={"options": {"spec": 4, "ctx": 4096}})
        assert r.status_code == 422
        violations = r.json()["error"]["violations"]
        assert any("--ctx cannot change while running" in v for v in violations)
        r = c.post("/v1/flags", json={"options": {"spec": 9}})  # a value EngineOptions refuses
        assert r.status_code == 422 and "--spec 9 must be 0 (off) or 2..8" in r.text
        r = c.post("/v1/flags", json={"flags": {"elastic": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "flags.elastic"
        r = c.post("/v1/flags", json={"options": {"spec": "2"}})
        assert r.status_code == 400 and "must be an integer" in r.text
        r = c.post("/v1/flags", json={"flags": {"repeat_min_tokens": 256}})
        assert r.status_code == 200 and server.loop.flags == FLAGS


def test_events_stream_the_loan_and_snapshots_first(server: Running, client: openai.OpenAI) -> None:
    with server.client() as c, c.stream("GET", "/v1/events?exclude=Token,TraceLine") as events:
        stream = _events(events)
        first = list(itertools.islice(stream, 3))
        assert {type(e).__name__ for e in first} == {"Ready", "LedgerChanged", "CacheChanged"}
        prompt = "the river runs through the old city " * 50  # ~400 fresh tokens: a repeat loan
        client.chat.completions.create(model="demo", max_tokens=4,
                                       messages=[{"role": "user", "content": prompt}])
        seen = []
        for e in stream:
            seen.append(e)
            if isinstance(e, RequestDone):
                break
    steps = [e.step for e in seen if isinstance(e, LoanStep)]
    assert steps[:2] == ["release", "plan"] and "restore" in steps
    assert not any(type(e).__name__ in ("Token", "TraceLine") for e in seen)
    with server.client() as c:
        r = c.get("/v1/events?types=Nope")
        assert r.status_code == 400 and "'Nope' is not an event type" in r.text


def _events(response: httpx.Response) -> Iterator[object]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield event_from_json(json.loads(line.removeprefix("data: ")))


def test_metrics_and_vram_say_what_the_engine_did(server: Running, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="demo", max_tokens=8,
                                   messages=[{"role": "user", "content": "What is a dog?"}])
    with server.client() as c:
        text = c.get("/metrics").text
        vram = c.get("/v1/vram").json()

    def metric(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert m is not None, name
        return float(m[1])

    assert metric('strata_requests_total{outcome="completed"}') >= 1
    assert metric("strata_tokens_generated_total") >= 8
    assert metric("strata_loans_total") >= 1 and metric("strata_cache_slots_lent") == 0
    assert metric("strata_drafts_offered_total") >= metric("strata_drafts_accepted_total") >= 0
    for region in vram["ledger"]["regions"]:
        assert metric(f'strata_ledger_region_bytes{{region="{region["name"]}"}}') == region[
            "used_bytes"]
    cache = vram["expert_cache"]
    assert cache["lent"] == 0 and cache["resident"] + cache["empty"] == cache["n_slots"]
    assert vram["busy"] is False


def test_tokenize_counts_like_the_engine(server: Running) -> None:
    with server.client() as c:
        tokens = c.post("/tokenize", json={"content": "What is a cat?"}).json()["tokens"]
        assert len(tokens) == server.loop.count_tokens("What is a cat?")
        assert c.post("/tokenize", json={"text": "x"}).status_code == 400


def test_forecast_answers_as_the_engine_does(server: Running) -> None:
    """POST /v1/forecast: the verdict the in-process composer gets (ServeLoop.preview on the
    conversation a chat completion would run), and a what-if through the guards."""
    from engine.server.codec import verdict_from_json
    from engine.server.worker import API_CONVERSATION

    messages = [{"role": "user", "content": "What is a cat?"},
                {"role": "assistant", "content": "A cat is a kind of feline."},
                {"role": "user", "content": "tell me about the river " * 80}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1})
        assert r.status_code == 200  # the startup loan is over: later messages may repeat it
        r = c.post("/v1/forecast", json={"messages": messages})
        assert r.status_code == 200, r.text
        got = verdict_from_json(r.json())
        conv = Conversation(id=API_CONVERSATION)
        for m in messages[:-1]:
            conv.add(m["role"], m["content"])
        here = server.loop.preview(conv, messages[-1]["content"])
        assert (got.prompt_tokens, got.fresh_tokens, got.kind, got.reason, got.line()) == (
            here.prompt_tokens, here.fresh_tokens, here.kind, here.reason, here.line())
        assert got.without_loan.workload == here.without_loan.workload
        assert r.json()["line"] == here.line()
        r = c.post("/v1/forecast", json={"fresh_tokens": 4096, "flags": {"repeat_loan": False}})
        assert r.status_code == 200
        off = verdict_from_json(r.json())
        assert off.kind is None and off.reason == "repeat loan off" and off.fresh_tokens == 4096
        assert server.loop.flags.repeat_loan  # a what-if applies nothing
        r = c.post("/v1/forecast", json={"fresh_tokens": 4096, "options": {"ctx": 4096}})
        assert r.status_code == 422 and any("--ctx cannot change while running" in v
                                            for v in r.json()["error"]["violations"])
        r = c.post("/v1/forecast", json={"fresh_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "fresh_tokens"
        r = c.post("/v1/forecast", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
