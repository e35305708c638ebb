"""`strata bench`: seed 000's tables on any model and device (see engine.bench)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.bench import (
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
from engine.cli.options import add_engine_args, engine_options
from engine.errors import StrataError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="loan off/on tables: fixed A/B, automatic, repeat, chunks")
    add_engine_args(p)
    p.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help="which tables (repeatable; default ab, auto, repeat)")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="fresh prompt tokens")
    p.add_argument("--max-new", type=int, default=32, help="completion cap")
    p.add_argument("--runs", type=int, default=3, help="runs per configuration (median, range)")
    p.add_argument("--json", help="also write the samples as JSON to this path")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured short request before the runs")
    p.add_argument("--h2d-gbs", type=float,
                   help="host-to-device GB/s (e.g. from strata gpu-probe): adds prefill / lower bound")
    p.add_argument("--peak-tflops", type=float,
                   help="the device's peak dense fp16 TFLOP/s, with --h2d-gbs")
    p.add_argument("--soak", type=int, metavar="N",
                   help="instead: N requests alternating long and short messages (repeat loan)")
    p.add_argument("--short-tokens", type=int, default=64, help="soak: short message tokens")
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
    if args.runs < 1 or args.prompt_tokens < 1 or args.max_new < 1:
        raise StrataError("--runs, --prompt-tokens and --max-new must be at least 1")
    hw = None
    if (args.h2d_gbs is None) != (args.peak_tflops is None):
        raise StrataError("--h2d-gbs and --peak-tflops go together (the lower bound needs both)")
    if args.h2d_gbs is not None:
        if args.h2d_gbs <= 0 or args.peak_tflops <= 0:
            raise StrataError("--h2d-gbs and --peak-tflops must be positive")
        hw = Hardware(args.h2d_gbs * 1e9, args.peak_tflops * 1e12)
    base = engine_options(args)
    if args.soak:
        result = soak(base.with_changes(ctx=max(args.ctx, 2 * args.prompt_tokens + 256)),
                      args.soak, args.prompt_tokens, args.short_tokens,
                      progress=lambda s: print(f"  {s}", file=sys.stderr))
        print(f"### Soak: {args.soak} requests, {args.prompt_tokens:,} / {args.short_tokens} "
              "tokens alternating, repeat loan on\n")
        print(result.markdown())
        return 0
    if args.ctx < args.prompt_tokens + args.max_new + 128:
        base = base.with_changes(ctx=args.prompt_tokens + args.max_new + 128)
    out, data = [], {}
    for i, name in enumerate(args.scenario or ["ab", "auto", "repeat"]):
        title, configs = scenario(name, base, args.prompt_tokens)
        rows = run_bench(configs, args.prompt_tokens, args.max_new, args.runs,
                         progress=lambda s: print(f"  {s}", file=sys.stderr),
                         warmup=not args.no_warmup and i == 0, hw=hw)
        out.append(markdown(rows, f"{title}: {args.prompt_tokens:,} fresh tokens, "
                                  f"{args.max_new}-token cap, {args.runs} runs"))
        data[name] = as_json(rows)
        print(out[-1] + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write("{" + ",".join(f'"{k}": {v}' for k, v in data.items()) + "}\n")
    return 0
