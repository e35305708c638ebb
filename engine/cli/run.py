"""`strata run`: one prompt, streamed to stdout, plan/trace/loan lines and timing on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    loan_flags,
    sampling_params,
)
from engine.conversation import Conversation
from engine.errors import StrataError
from engine.serve import ServeLoop


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate from one prompt, headless")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (rendered with the chat template)")
    src.add_argument("--tokens-file", help="file of whitespace-separated token ids (raw prompt)")
    p.add_argument("--max-new", type=int, default=64, help="tokens to generate (default 64)")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def read_tokens_file(path: str, n_vocab: int) -> list[int]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise StrataError(f"--tokens-file {path}: {exc.strerror}") from None
    words = text.split()
    bad = next((t for t in words if not t.isdigit()), None)
    if bad is not None:
        raise StrataError(f"--tokens-file {path}: '{bad[:20]}' is not a token id")
    ids = [int(t) for t in words]
    if not ids:
        raise StrataError(f"--tokens-file {path}: no token ids in the file")
    out_of_range = [t for t in ids if t >= n_vocab]
    if out_of_range:
        raise StrataError(f"--tokens-file {path}: token id {out_of_range[0]} is outside 0..{n_vocab - 1}")
    return ids


def stderr_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class _Streams:
    """Generated text on stdout, lines on stderr: a line that comes while the text's line is
    open (the trace after decode) first ends that line, so the two never share one."""

    def __init__(self) -> None:
        self.open = False

    def text(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.open = not text.endswith("\n")

    def line(self, line: str) -> None:
        self.end_text()
        stderr_line(line)

    def end_text(self) -> None:
        if self.open:
            self.text("\n")


def run(args: argparse.Namespace) -> int:
    if args.max_new < 1:
        raise StrataError(f"--max-new {args.max_new} must be at least 1")
    params = sampling_params(args)
    options = engine_options(args)
    flags = loan_flags()
    for w in flags.warnings:
        stderr_line(f"strata: warning: {w}")
    out = _Streams()
    loop = ServeLoop.create(options, flags, on_trace=out.line)
    n_vocab = loop.rt.model.hp.n_vocab
    write = out.text
    if args.tokens_file:
        ids = read_tokens_file(args.tokens_file, n_vocab)
        if len(ids) + args.max_new > options.ctx:
            raise StrataError(
                f"--tokens-file holds {len(ids)} tokens; with --max-new {args.max_new} that "
                f"exceeds --ctx {options.ctx}; raise --ctx"
            )
        reply = loop.complete(ids, params, args.max_new, on_text=write)
    else:
        reply = loop.chat(Conversation(), args.prompt, params, args.max_new, on_text=write)
    out.end_text()
    stderr_line(reply.timing.line())
    return 0
