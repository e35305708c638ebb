"""`strata logits`: float32 logits [n_tokens, n_vocab] of one teacher-forced forward pass."""

from __future__ import annotations

import argparse
import re

import numpy as np

from engine.cli.options import integer
from engine.errors import StrataError
from engine.model.loader import load_model
from engine.request.session import Session
from engine.synth.demo import resolve_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logits", help="write the logits of every position to a .npy file")
    p.add_argument("model", help="a .gguf path or a preset name")
    p.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 5,17,300")
    p.add_argument("--out", required=True, help="output .npy path")
    p.add_argument("--kv", choices=("f16", "int8", "q4_0"), default="f16")
    p.add_argument("--chunk", type=integer, default=0, help="prefill chunk tokens (0: one pass)")
    p.set_defaults(func=run)


_ID = re.compile(r"-?[0-9]{1,18}")  # ASCII digits; no vocabulary comes near 18 of them


def parse_tokens(text: str) -> list[int]:
    words = [t for t in text.replace(" ", "").split(",") if t]
    if not all(_ID.fullmatch(t) for t in words):  # int() also takes '1_0' and '٣'
        raise StrataError(f"--tokens '{text[:40]}' must be comma-separated integers")
    ids = [int(t) for t in words]
    if not ids:
        raise StrataError("--tokens is empty; give at least one token id")
    return ids


def compute_logits(path: str, ids: list[int], kv: str = "f16", chunk: int = 0) -> np.ndarray:
    """Teacher-forced logits [len(ids), n_vocab] float32."""
    model = load_model(resolve_model(path))
    bad = [t for t in ids if not 0 <= t < model.hp.n_vocab]
    if bad:
        raise StrataError(f"--tokens: id {bad[0]} is outside 0..{model.hp.n_vocab - 1}")
    session = Session(model, n_ctx=len(ids), kv_kind=kv)
    out = session.prefill(ids, chunk or len(ids), logits="all")
    return np.asarray(out, dtype=np.float32)


def run(args: argparse.Namespace) -> int:
    ids = parse_tokens(args.tokens)
    logits = compute_logits(args.model, ids, args.kv, args.chunk)
    try:
        np.save(args.out, logits)
    except OSError as exc:
        raise StrataError(f"--out {args.out}: {exc.strerror}") from None
    print(f"wrote {args.out}: float32 {list(logits.shape)}")
    return 0
