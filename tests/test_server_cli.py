"""`strata serve` as a user runs it: a process on a free port with the loan flags from the
environment and an API key, stopped with Ctrl+C (SIGINT); bad options are one line, exit 2."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from servers import FLAGS, LOAN, run_argv, strata


def test_strata_serve_answers_with_a_key_and_stops_on_ctrl_c(demo_path: Path) -> None:
    env = {**os.environ, **FLAGS.as_env(), "STRATA_API_KEY": "s3cret"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(demo_path), "--port", "0",
         *run_argv(LOAN)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        lines = []
        while not (m := re.search(r"listening on (http://\S+) ", lines[-1] if lines else "")):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert "bearer token required" in lines[-1]
        url = m[1]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        reply = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "What is a cat?"}], max_tokens=8)
        assert reply.choices[0].message.content.startswith("A cat is")
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="the API key is wrong"):
            wrong.models.list()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("strata serve: stopped; requests: 1 completed, 0 cancelled"), last
    assert "; 0 cache slots lent;" in last and "Traceback" not in err


def test_a_taken_port_is_one_line_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = strata("serve", "--model", "no-such-model.gguf", "--port",
                     str(taken.getsockname()[1]))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "address already in use" in out.stderr.lower()
    assert "choose another port" in out.stderr


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--queue", "-1"], "--queue -1 must be >= 0"),
        (["--port", "70000"], "--port 70000 must be in 0..65535"),
        (["--api-key", " "], "--api-key (or STRATA_API_KEY) is empty"),
        (["--max-new", "0"], "--max-new 0 must be at least 1"),
    ],
)
def test_bad_server_options_are_one_line(argv: list[str], words: str) -> None:
    out = strata("serve", *argv)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr


def test_bench_serve_prints_its_table(demo_path: Path) -> None:
    out = strata("bench-serve", "--model", str(demo_path), "--ctx", "512", "--runs", "1",
                 "--max-new", "8", "--prompt", "What is a cat?")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| `strata")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| `strata run` (engine clock)", "| `strata serve` (engine clock)",
        "| `strata serve` (client clock, streamed)"]
    assert all(r.split(" | ")[1] == "8" for r in rows)  # the same tokens through both
    assert "through the server / strata run (TG medians): " in out.stdout
