"""Argument groups shared by several sub-commands."""

from __future__ import annotations

import argparse

from engine.kv import KV_KINDS
from engine.sampler import SamplingParams


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="a .gguf path, or a preset name such as 'demo'")
    p.add_argument("--ctx", type=int, default=8192, help="KV cache cells (default 8192)")
    p.add_argument("--kv", choices=KV_KINDS, default="f16", help="KV cache storage type")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
