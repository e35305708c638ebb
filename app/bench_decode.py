"""`python -m app.bench_decode`: the app's decode speed beside `strata run`'s, as a table.

Both sides get the same engine options, loan flags (as STRATA_PREFILL_* variables), sampling
and prompt; each run is a fresh process (`strata run`, or the app headless at a fixed terminal
size driven by a pilot that types the prompt and presses Enter), interleaved CLI/app. Decode
speed is the engine's own figure (`G generated in Z ms`): the CLI's timing line, the app's
`RequestDone`. The app side also reports its UI thread's CPU time while the engine decoded (first
token to RequestDone), as a share of that time (time the engine thread waits for under the GIL)
and per generated token.

    python -m app.bench_decode --runs 5 --max-new 256 [strata chat options]

The trained demo ends its answers after a few dozen tokens; `--model random-demo` (its shapes,
random weights) decodes all of --max-new.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from textual.pilot import Pilot

from app.app import StrataApp
from app.config import ChatConfig, add_chat_args, chat_config
from app.scenes import wait_ready
from app.store import Store
from app.widgets.prompt_input import PromptInput
from app.widgets.timing_panel import TimingPanel
from engine.cli import OneLineParser, build_parser
from engine.cli.options import engine_options, options_argv, sampling_params
from engine.errors import StrataError
from engine.trace.events import Event, RequestDone, Token

DEFAULT_PROMPT = "Tell me how the expert cache lends its tail to the prompt path."
SIZE = (120, 40)
POLL_S = 0.05
# `strata run`'s timing line: "..., G generated in Z ms (W tok/s), ..."
GENERATED = re.compile(r"(\d+) generated in (\d+) ms")


@dataclass(frozen=True)
class Sample:
    """One run: tokens generated, decode time, and (app only) the UI thread's CPU time while
    the engine decoded, over that wall time."""

    generated: int
    decode_ms: float
    ui_cpu_ms: float | None = None
    ui_wall_ms: float | None = None

    @property
    def tok_s(self) -> float:
        return self.generated / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0


def run_argv(config: ChatConfig, prompt: str) -> list[str]:
    """The full `strata run` command line for `config`; refuses one that would differ."""
    p = config.params
    argv = [
        "run", "--prompt", prompt, "--max-new", str(config.max_new),
        *options_argv(config.options),
        "--temperature", str(p.temperature), "--top-k", str(p.top_k),
        "--top-p", str(p.top_p), "--seed", str(p.seed),
    ]
    args = build_parser().parse_args(argv)
    if engine_options(args) != config.options or sampling_params(args) != config.params:
        raise StrataError(f"strata {' '.join(argv)} does not reproduce the app's options")
    return argv


def cli_sample(config: ChatConfig, prompt: str) -> Sample:
    """One `strata run` in a fresh process; its timing line parsed."""
    env = {**os.environ, **config.flags.as_env()}
    cmd = [sys.executable, "-m", "engine.cli", *run_argv(config, prompt)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    match = GENERATED.search(out.stderr)
    if out.returncode != 0 or match is None:
        raise StrataError(f"strata run failed: {out.stderr.strip()[-500:]}")
    return Sample(int(match[1]), float(match[2]))


def app_sample(argv: list[str], prompt: str) -> Sample:
    """One headless app run in a fresh process (this module with --child)."""
    cmd = [sys.executable, "-m", "app.bench_decode", "--child", "--prompt", prompt, *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise StrataError(f"the app run failed: {(out.stderr or out.stdout).strip()[-500:]}")
    return Sample(**json.loads(out.stdout.strip().splitlines()[-1]))


class DecodeClock:
    """The UI thread's CPU time while the engine decodes, read on the engine thread from its
    bus: from the first generated token to RequestDone."""

    def __init__(self) -> None:
        self._clock = time.pthread_getcpuclockid(threading.main_thread().ident or 0)
        self.start: tuple[float, float] | None = None  # (UI CPU s, wall s)
        self.end: tuple[float, float] | None = None

    def __call__(self, event: Event) -> None:
        if isinstance(event, Token) and self.start is None:
            self.start = (time.clock_gettime(self._clock), time.perf_counter())
        elif isinstance(event, RequestDone):
            self.end = (time.clock_gettime(self._clock), time.perf_counter())

    @property
    def ui_cpu_ms(self) -> float:
        assert self.start is not None and self.end is not None
        return (self.end[0] - self.start[0]) * 1e3

    @property
    def wall_ms(self) -> float:
        assert self.start is not None and self.end is not None
        return (self.end[1] - self.start[1]) * 1e3


def child(config: ChatConfig, prompt: str) -> Sample:
    """Drive the app headless: wait for the engine, type the prompt, Enter, wait for the reply."""
    store = Store.open(Path(tempfile.mkdtemp(prefix="strata-bench-")) / "bench.sqlite3")
    app = StrataApp(config, store=store)
    clock = DecodeClock()
    app.link.bus.subscribe(clock)

    async def drive(pilot: Pilot) -> None:
        await wait_ready(pilot)
        app.query_one(PromptInput).load_text(prompt)
        await pilot.press("enter")
        timing = app.query_one(TimingPanel)
        # not pilot.pause: it forces a frame of its own on every call
        while app.running or timing.done is None or not store.list():  # answered and saved
            await asyncio.sleep(POLL_S)
        done = timing.done
        if done.cancelled or clock.start is None:
            app.exit(None)
            return
        app.exit(Sample(done.generated, done.decode_s * 1e3, clock.ui_cpu_ms, clock.wall_ms))

    sample = app.run(headless=True, size=SIZE, auto_pilot=drive)
    if not isinstance(sample, Sample):
        raise StrataError(f"the app did not answer: {app.error_line or 'no reply'}")
    return sample


def spread(values: list[float], fmt: str = "{:,.1f}") -> tuple[str, str]:
    """(median, 'min–max') of `values`, formatted."""
    lo, hi = min(values), max(values)
    return fmt.format(statistics.median(values)), f"{fmt.format(lo)}–{fmt.format(hi)}"


def table(config: ChatConfig, prompt: str, cli: list[Sample], app: list[Sample]) -> str:
    """The Markdown table of both runners and the app/CLI ratio of the medians."""
    o = config.options
    flags = " ".join(f"{k.removeprefix('STRATA_PREFILL_')}={v}"
                     for k, v in config.flags.as_env().items())
    lines = [
        (f"decode speed, app headless ({SIZE[0]}x{SIZE[1]}) vs `strata run`: model {o.model}, "
         f"{' '.join(options_argv(o)) or '(defaults)'}, {flags}"),
        (f"prompt {prompt!r}, --max-new {config.max_new}, {len(cli)} runs each, interleaved, "
         "fresh process per run"),
        "",
        ("| runner | generated | decode tok/s median | range | UI thread CPU while decoding "
         "| UI thread CPU a token |"),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, samples in (("strata run", cli), ("app (headless)", app)):
        med, rng = spread([s.tok_s for s in samples])
        gen = "/".join(sorted({str(s.generated) for s in samples}))
        ui = per_token = "–"
        if samples[0].ui_cpu_ms is not None:
            share = [100 * (s.ui_cpu_ms or 0) / (s.ui_wall_ms or 1) for s in samples]
            ui = f"{statistics.median(share):.1f}% ({spread(share, '{:.1f}')[1]}%)"
            ms = [(s.ui_cpu_ms or 0) / max(1, s.generated) for s in samples]
            per_token = f"{statistics.median(ms):.3f} ms ({spread(ms, '{:.3f}')[1]})"
        lines.append(f"| {name} | {gen} | {med} | {rng} | {ui} | {per_token} |")
    ratio = statistics.median(s.tok_s for s in app) / statistics.median(s.tok_s for s in cli)
    lines += ["", f"app / strata run (medians): {ratio:.2f}"]
    short = min(s.generated for s in (*cli, *app))
    if short < config.max_new:
        lines.append(f"the model ended an answer after {short} tokens (of --max-new "
                     f"{config.max_new}): the decode is short, costs paid once a request weigh "
                     "more; --model random-demo decodes them all")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = OneLineParser(prog="python -m app.bench_decode", description=__doc__.split("\n")[0])
    add_chat_args(parser)
    parser.add_argument("--runs", type=int, default=5, help="runs per runner (default 5)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        config = chat_config(args)
        if args.child:
            sys.stdout.write(json.dumps(child(config, args.prompt).__dict__) + "\n")
            return 0
        if args.runs < 1:
            raise StrataError(f"--runs {args.runs} must be at least 1")
        app_argv = _without(argv, ("--runs", "--prompt"))
        cli: list[Sample] = []
        app: list[Sample] = []
        for i in range(args.runs):
            cli.append(cli_sample(config, args.prompt))
            app.append(app_sample(app_argv, args.prompt))
            sys.stderr.write(f"run {i + 1}/{args.runs}: strata run {cli[-1].tok_s:,.1f} tok/s, "
                             f"app {app[-1].tok_s:,.1f} tok/s\n")
    except StrataError as exc:
        sys.stderr.write(f"strata: error: {exc}\n")
        return 2
    sys.stdout.write(table(config, args.prompt, cli, app) + "\n")
    return 0


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` less the given options and their values (given apart or joined by `=`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in options)):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
