"""`strata bench-serve`: decode speed through `strata serve` beside `strata run`'s, as a table
(median and range of interleaved runs, a fresh process each; `engine.tools.serve_bench`).

    strata bench-serve --model random-demo --runs 5 --max-new 256 [engine and sampling options]
"""

from __future__ import annotations

import argparse
import sys

from engine.cli.options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    integer,
    loan_flags,
    options_argv,
    sampling_params,
)
from engine.errors import StrataError
from engine.tools.serve_bench import run_sample, serve_sample, table

DEFAULT_PROMPT = "Tell me how the expert cache lends its tail to the prompt path."


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-serve", help="decode speed through strata serve vs strata run")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--runs", type=integer, default=5, help="runs per runner (default 5)")
    p.add_argument("--max-new", type=integer, default=256, help="tokens per answer (default 256)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    # random weights answer up to --max-new; the trained demo ends its answers within ~50 tokens
    p.set_defaults(func=bench_serve, model="random-demo")


def bench_serve(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise StrataError(f"--runs {args.runs} must be at least 1")
    if args.max_new < 2:
        raise StrataError(f"--max-new {args.max_new} must be at least 2 (a decode step)")
    options, params, flags = engine_options(args), sampling_params(args), loan_flags()
    argv = options_argv(options)
    run, serve = [], []
    for i in range(args.runs):
        run.append(run_sample(argv, args.prompt, args.max_new, params))
        serve.append(serve_sample(argv, args.prompt, args.max_new, params))
        sys.stderr.write(f"run {i + 1}/{args.runs}: strata run {run[-1].engine_tok_s:,.1f} "
                         f"tok/s, through the server {serve[-1].client_tok_s or 0:,.1f} tok/s "
                         "(client clock)\n")
    loan = " ".join(f"{k.removeprefix('STRATA_PREFILL_')}={v}" for k, v in flags.as_env().items())
    shown = argv if "--model" in argv else ["--model", options.model, *argv]
    title = (f"decode speed through `strata serve` vs `strata run`: {' '.join(shown)}"
             f", {loan}\nprompt {args.prompt!r}, --max-new {args.max_new}, {args.runs} runs "
             "each, interleaved, fresh process per run")
    sys.stdout.write(table(title, run, serve) + "\n")
    return 0
