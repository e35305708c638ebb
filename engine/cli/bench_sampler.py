"""`strata bench-sampler`: the host's time to pick a token from a vocabulary's logits.

Decoding picks one token a step on the host, after the step's logits come down (and a verify
window one a row); over a 151,936-token vocabulary that time is a share of a GPU step (issue
32). The table gives, per sampling setting, the median and range of `Sampler.sample` on the
same seeded logits, one position after another.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np

from engine.cli.options import integer, number
from engine.errors import FlagError
from engine.request.sampler import Sampler, SamplingParams, distribution

SETTINGS = (  # (label, params): the defaults, each filter alone, neither, greedy
    ("greedy", SamplingParams()),
    ("T 1.0, top-k 40, top-p 0.95 (default)", SamplingParams(temperature=1.0)),
    ("T 1.0, top-k 40", SamplingParams(temperature=1.0, top_p=1.0)),
    ("T 1.0, top-p 0.95", SamplingParams(temperature=1.0, top_k=0)),
    ("T 1.0, no filter", SamplingParams(temperature=1.0, top_k=0, top_p=1.0)),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-sampler", help="benchmark picking a token from the logits (host)")
    p.add_argument("--vocab", type=integer, default=151_936,
                   help="vocabulary size (default 151,936: Qwen3's)")
    p.add_argument("--runs", type=integer, default=50, help="draws per cell (default 50)")
    p.add_argument("--scale", type=number, default=8.0,
                   help="logits are seeded normal x this (default 8: a peaked distribution)")
    p.set_defaults(func=run)


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    """Milliseconds of `runs` calls of fn, one each (after one untimed call)."""
    fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def cell(ms: list[float]) -> str:
    return f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})"


def run(args: argparse.Namespace) -> int:
    if args.vocab < 2 or args.runs < 1 or not args.scale > 0:
        raise FlagError("--vocab must be >= 2, --runs >= 1 and --scale > 0")
    logits = (np.random.default_rng(0).standard_normal(args.vocab) * args.scale).astype(np.float32)
    print(f"vocabulary {args.vocab:,}, logits normal x {args.scale:g} (seeded), "
          f"{args.runs} draws a cell, ms median (range)\n")
    print("| sampling | `Sampler.sample` | tokens kept |")
    print("|---|---:|---:|")
    for label, params in SETTINGS:
        sampler, positions = Sampler(params), itertools.count()
        ms = timed(lambda s=sampler, p=positions: s.sample(logits, next(p)), args.runs)
        kept = int(np.count_nonzero(distribution(logits, params)))
        print(f"| {label} | {cell(ms)} | {kept:,} |")
    return 0
