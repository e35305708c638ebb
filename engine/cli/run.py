"""`strata run`: one prompt, streamed to stdout, timing line on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.options import add_model_args, add_sampling_args, sampling_params
from engine.errors import StrataError
from engine.model.loader import load_model
from engine.session import Session, Timing
from engine.synth.demo import resolve_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate from one prompt, headless")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (rendered with the chat template)")
    src.add_argument("--tokens-file", help="file of whitespace-separated token ids (raw prompt)")
    p.add_argument("--raw", action="store_true", help="send --prompt without the chat template")
    p.add_argument("--max-new", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (default 512)")
    add_sampling_args(p)
    p.set_defaults(func=run)


def read_tokens_file(path: str, n_vocab: int) -> list[int]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise StrataError(f"--tokens-file {path}: {exc.strerror}") from None
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        bad = next(t for t in text.split() if not t.lstrip("-").isdigit())
        raise StrataError(f"--tokens-file {path}: '{bad[:20]}' is not a token id") from None
    if not ids:
        raise StrataError(f"--tokens-file {path}: no token ids in the file")
    out_of_range = [t for t in ids if not 0 <= t < n_vocab]
    if out_of_range:
        raise StrataError(
            f"--tokens-file {path}: token id {out_of_range[0]} is outside 0..{n_vocab - 1}"
        )
    return ids


def run(args: argparse.Namespace) -> int:
    if args.max_new < 1:
        raise StrataError(f"--max-new {args.max_new} must be at least 1")
    if args.chunk < 1:
        raise StrataError(f"--chunk {args.chunk} must be at least 1")
    params = sampling_params(args)
    model = load_model(resolve_model(args.model))
    tok = model.tokenizer
    if args.tokens_file:
        ids = read_tokens_file(args.tokens_file, model.hp.n_vocab)
    elif args.raw:
        ids = tok.encode(args.prompt)
    else:
        ids = tok.encode(tok.render_chat([{"role": "user", "content": args.prompt}]))
    session = Session(model, n_ctx=max(args.ctx, len(ids) + args.max_new), kv_kind=args.kv)
    timing = Timing()
    stream = tok.stream()
    for t in session.generate(ids, args.max_new, params, args.chunk, tok.eog_ids, timing):
        if t in tok.eog_ids:
            break
        sys.stdout.write(stream.push(t))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    sys.stderr.write(timing.line() + "\n")
    return 0
