"""The server's overhead: decode speed through `strata serve` beside `strata run`'s, as a table.

Both get the same engine options, loan flags (the STRATA_PREFILL_* variables of this
process), sampling, prompt and token count; each run is a fresh process (`strata run`, or
`strata serve` on a free port answering one streamed request from this process's HTTP client,
then stopped with SIGINT), interleaved run/serve. Three clocks: `strata run`'s own timing line;
the server's engine (`timings.predicted_per_second`, the same figure inside the server
process); and the client's, tokens after the first over the time from the first streamed text
to the last — what a user of the API sees.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from engine.errors import StrataError
from engine.request.sampler import SamplingParams

# `strata run`'s timing line: "prompt P tokens = ... read in X ms (...), G generated in Z ms"
TIMING = re.compile(r"read in (\d+) ms .*?(\d+) generated in (\d+) ms")
LISTENING = re.compile(r"listening on (http://\S+) ")
START_TIMEOUT_S = 300.0  # a preset's model is built on its first use


@dataclass(frozen=True)
class Sample:
    """One run: tokens generated, decode speed on the engine's clock (and, through the
    server, on the client's), and the request's time (prefill and decode)."""

    generated: int
    engine_tok_s: float
    request_s: float
    client_tok_s: float | None = None


def strata_argv(command: str, options_argv: list[str], prompt: str, max_new: int,
                params: SamplingParams) -> list[str]:
    sampling = ["--temperature", str(params.temperature), "--top-k", str(params.top_k),
                "--top-p", str(params.top_p), "--seed", str(params.seed)]
    head = [sys.executable, "-m", "engine.cli", command, *options_argv, *sampling]
    if command == "run":
        return [*head, "--prompt", prompt, "--max-new", str(max_new)]
    return [*head, "--port", "0", "--max-new", str(max_new)]


def run_sample(options_argv: list[str], prompt: str, max_new: int,
               params: SamplingParams) -> Sample:
    """One `strata run` in a fresh process; its timing line parsed."""
    out = subprocess.run(strata_argv("run", options_argv, prompt, max_new, params),
                         capture_output=True, text=True, check=False, env=os.environ.copy())
    m = TIMING.search(out.stderr)
    if out.returncode != 0 or m is None:
        raise StrataError(f"strata run failed: {out.stderr.strip()[-500:]}")
    prefill_ms, generated, decode_ms = int(m[1]), int(m[2]), int(m[3])
    return Sample(generated, generated / (decode_ms / 1e3), (prefill_ms + decode_ms) / 1e3)


def serve_sample(options_argv: list[str], prompt: str, max_new: int,
                 params: SamplingParams) -> Sample:
    """One `strata serve` in a fresh process, one streamed request, then Ctrl+C."""
    proc = subprocess.Popen(strata_argv("serve", options_argv, prompt, max_new, params),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = _listening(proc)
        sample = stream_once(url, prompt, max_new, params)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if proc.returncode != 0:
            raise StrataError(f"strata serve did not stop cleanly: {err.strip()[-500:]}")
        return sample
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _listening(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise StrataError(f"strata serve did not start: {''.join(lines)[-500:]}")
        lines.append(line)
        if m := LISTENING.search(line):
            return m[1]
    raise StrataError("strata serve did not start in time")


def stream_once(url: str, prompt: str, max_new: int, params: SamplingParams) -> Sample:
    """Stream one chat completion; the client's clock around its text."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_new,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "seed": params.seed, "stream": True}
    first = last = None
    final: dict = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise StrataError(f"the server answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if any(c["delta"].get("content") for c in chunk["choices"]):
                last = time.perf_counter()
                first = first or last
            if "timings" in chunk:
                final = chunk["timings"]
    done = time.perf_counter()
    generated = final.get("predicted_n", 0)
    client = ((generated - 1) / (last - first)
              if first is not None and last is not None and last > first else None)
    return Sample(generated, final.get("predicted_per_second", 0.0), done - t0, client)


def spread(values: list[float], fmt: str = "{:,.1f}") -> tuple[str, str]:
    """(median, 'min–max') of `values`, formatted."""
    return fmt.format(statistics.median(values)), f"{fmt.format(min(values))}–{fmt.format(max(values))}"


def table(title: str, run: list[Sample], serve: list[Sample]) -> str:
    """The Markdown table of the three clocks, and the server/run ratios of the medians."""
    rows: list[tuple[str, list[Sample], Callable[[Sample], float]]] = [
        ("`strata run` (engine clock)", run, lambda s: s.engine_tok_s),
        ("`strata serve` (engine clock)", serve, lambda s: s.engine_tok_s),
        ("`strata serve` (client clock, streamed)", serve, lambda s: s.client_tok_s or 0.0),
    ]
    lines = [title, "",
             "| runner | generated | TG tok/s median | range | request s median |",
             "|---|---:|---:|---:|---:|"]
    for name, samples, tok_s in rows:
        med, rng = spread([tok_s(s) for s in samples])
        gen = "/".join(sorted({str(s.generated) for s in samples}))
        req = statistics.median(s.request_s for s in samples)
        lines.append(f"| {name} | {gen} | {med} | {rng} | {req:.2f} |")
    base = statistics.median(s.engine_tok_s for s in run)
    ratios = [f"{statistics.median(tok_s(s) for s in samples) / base:.2f} ({name.split(' (')[1]}"
              for name, samples, tok_s in rows[1:]]
    lines += ["", f"through the server / strata run (TG medians): {', '.join(ratios)}"]
    return "\n".join(lines)
