"""`strata bench`: seed 000's tables on any model and device (see engine.tools.bench); the soak;
`--forecast`: the loan forecast against measured prefills (engine.tools.bench_forecast)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.options import add_engine_args, engine_options, integer, number
from engine.errors import StrataError
from engine.request.sampler import SamplingParams
from engine.tools.bench import (
    DEFAULT_SCENARIOS,
    SAMPLED,
    SCENARIOS,
    TITLES,
    Hardware,
    as_json,
    markdown,
    merged,
    run_bench,
    scenario,
    soak,
)
from engine.tools.bench_forecast import as_json as forecast_json
from engine.tools.bench_forecast import markdown as forecast_markdown
from engine.tools.bench_forecast import run_forecast_bench


def token_counts(text: str) -> list[int]:
    """'8192,31258' -> [8192, 31258]: counts >= 1, comma separated."""
    try:
        counts = [integer(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count or a comma-separated list of them") from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: every token count must be at least 1")
    return counts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="loan off/on tables: fixed A/B, automatic, repeat, chunks")
    add_engine_args(p)
    p.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help=f"which tables (repeatable; default {', '.join(DEFAULT_SCENARIOS)})")
    p.add_argument("--prompt-tokens", type=token_counts, default=[4096], metavar="N[,N...]",
                   help="fresh prompt tokens; a list runs each size (the soak cycles its long "
                        "messages through it)")
    p.add_argument("--max-new", type=integer, default=32, help="completion cap")
    p.add_argument("--runs", type=integer, default=3, help="runs per configuration (median, range)")
    p.add_argument("--json", help="also write the samples as JSON to this path")
    p.add_argument("--temperature", type=number, default=SAMPLED.temperature,
                   help="the decode table's sampled rows (greedy rows beside them; default "
                        f"{SAMPLED.temperature})")
    p.add_argument("--top-k", type=integer, default=SAMPLED.top_k)
    p.add_argument("--top-p", type=number, default=SAMPLED.top_p)
    p.add_argument("--seed", type=integer, default=SAMPLED.seed)
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured short request before the runs")
    p.add_argument("--h2d-gbs", type=number,
                   help="host-to-device GB/s (e.g. from strata gpu-probe): adds prefill / lower bound")
    p.add_argument("--peak-tflops", type=number,
                   help="the device's peak dense fp16 TFLOP/s, with --h2d-gbs")
    p.add_argument("--soak", type=integer, metavar="N",
                   help="instead: N requests alternating long and short messages (repeat loan)")
    p.add_argument("--short-tokens", type=integer, default=64, help="soak: short message tokens")
    p.add_argument("--auto", action="store_true",
                   help="soak: STRATA_PREFILL_REPEAT_MIN_TOKENS=auto (the forecast decides); "
                        "every decision is checked against the prompt run the other way")
    p.add_argument("--forecast", action="store_true",
                   help="instead: forecast against measured prefill per size, loan off and on "
                        "(startup loan, a calibration pair, then --runs pairs)")
    p.add_argument("--fresh-rates", action="store_true",
                   help="forecast: start from the device's default rates, not the stored ones")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="instead: print the tables of these --json files, runs pooled")
    p.set_defaults(func=run)


def print_merged(paths: list[str]) -> int:
    """The tables of several `--json` files, each configuration's runs pooled (a 10-minute
    device call holds two runs of a long prompt; two calls make four)."""
    texts = {}
    for path in paths:
        try:
            texts[path] = Path(path).read_text()
        except OSError as e:
            raise StrataError(f"bench --merge: cannot read {path}: {e.strerror}") from None
    try:
        tables = merged(texts)
    except ValueError as e:
        raise StrataError(f"bench --merge: {e}") from None
    for name, rows in tables.items():
        n_runs = max(len(r.samples) for r in rows)
        title = f"{TITLES.get(name, name)}: {n_runs} runs from {len(paths)} files"
        print(markdown(rows, title) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return print_merged(args.merge)
    if args.runs < 1 or args.max_new < 1:
        raise StrataError("--runs and --max-new must be at least 1")
    hw = None
    if (args.h2d_gbs is None) != (args.peak_tflops is None):
        raise StrataError("--h2d-gbs and --peak-tflops go together (the lower bound needs both)")
    if args.h2d_gbs is not None:
        if args.h2d_gbs <= 0 or args.peak_tflops <= 0:
            raise StrataError("--h2d-gbs and --peak-tflops must be positive")
        hw = Hardware(args.h2d_gbs * 1e9, args.peak_tflops * 1e12)
    base = engine_options(args)
    sizes: list[int] = args.prompt_tokens
    sampled = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed)
    if sampled.greedy:
        raise StrataError("--temperature 0 is greedy, and the decode table has greedy rows "
                          "already; give a temperature above 0 for its sampled rows")

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr)

    if args.forecast:
        shots = run_forecast_bench(base, sizes, args.runs, args.max_new, args.fresh_rates,
                                   not args.no_warmup, progress)
        print(forecast_markdown(shots, (
            f"Forecast against measured prefill: {' / '.join(f'{n:,}' for n in sizes)} "
            f"fresh tokens, {args.runs} measured runs after a calibration pair")))
        if args.json:
            Path(args.json).write_text(forecast_json(shots) + "\n")
        return 0
    if args.soak:
        result = soak(base.with_changes(ctx=max(args.ctx, 2 * max(sizes) + 256)),
                      args.soak, sizes, args.short_tokens, progress=progress, auto=args.auto)
        longs = ", ".join(f"{n:,}" for n in sizes)
        how = ("STRATA_PREFILL_REPEAT_MIN_TOKENS=auto, each decision checked against its twin"
               if args.auto else "repeat loan on")
        print(f"### Soak: {args.soak} requests, {longs} / {args.short_tokens} tokens "
              f"alternating, {how}\n")
        print(result.markdown())
        return 0
    out, data = [], {}
    for n in sizes:
        opts = base.with_changes(ctx=max(args.ctx, n + args.max_new + 128))
        for i, name in enumerate(args.scenario or DEFAULT_SCENARIOS):
            title, configs = scenario(name, opts, n, sampled)
            rows = run_bench(configs, n, args.max_new, args.runs, progress=progress,
                             warmup=not args.no_warmup and i == 0 and n == sizes[0], hw=hw)
            greedy = ", greedy decoding" if all(c.params.greedy for c in configs) else ""
            out.append(markdown(rows, f"{title}: {n:,} fresh tokens, "
                                      f"{args.max_new}-token cap{greedy}, {args.runs} runs"))
            data[name if len(sizes) == 1 else f"{name}-{n}"] = as_json(rows)
            print(out[-1] + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write("{" + ",".join(f'"{k}": {v}' for k, v in data.items()) + "}\n")
    return 0
