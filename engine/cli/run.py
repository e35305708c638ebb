"""`strata run`: one prompt, streamed to stdout, plan/trace/loan lines and timing on stderr;
on CUDA also the process's device-memory peak (NVML) against `--vram-limit`."""

from __future__ import annotations

import argparse
import codecs
import re
import sys

from engine.backend.process_memory import MemoryReading
from engine.bounded_input import read_capped
from engine.cli.options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    integer,
    loan_flags,
    sampling_params,
)
from engine.devices import peak_sampler, vram_limit_bytes
from engine.errors import StrataError
from engine.memory.sizes import MiB
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate from one prompt, headless")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (rendered with the chat template)")
    src.add_argument("--tokens-file",
                     help="file of whitespace-separated decimal token ids (a raw prompt)")
    p.add_argument("--max-new", type=integer, default=64, help="tokens to generate (default 64)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the answer before this text (repeatable)")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


_WORD = re.compile(rb"\S+")  # whitespace as bytes.split sees it: ASCII only
TOKENS_FILE_FORMAT = "token ids in ASCII decimal separated by whitespace, such as '5 17 300'"
# Bytes a token id may take in a `--tokens-file`: 18 digits and room for whitespace.
TOKEN_FILE_BYTES = 32


def tokens_file_limit(ctx: int) -> int:
    """The most bytes a `--tokens-file` may hold: what a prompt that fits `--ctx` takes, at
    TOKEN_FILE_BYTES a token, and never less than a MiB."""
    return max(MiB, ctx * TOKEN_FILE_BYTES)


def read_tokens_file(path: str, limit_bytes: int = MiB) -> list[int]:
    """The token ids of a `--tokens-file` (TOKENS_FILE_FORMAT): a raw prompt, no chat
    template. A file that is not a regular file, or holds more than `limit_bytes`, is refused
    before it is read; anything else is a StrataError naming the file, the line and byte
    offset."""
    if not path:
        raise StrataError("--tokens-file is empty; give the path of a file of token ids")
    data = read_capped(path, limit_bytes, f"--tokens-file {path}",
                       "give a file of token ids that fits --ctx (raise --ctx for a longer one)")
    ids = []
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # Notepad's
    for m in _WORD.finditer(data, start):
        word = m.group()
        if not word.isdigit():  # bytes.isdigit: ASCII digits only
            raise StrataError(f"--tokens-file {path}: {_not_an_id(data, m.start(), word)}; "
                              f"expected {TOKENS_FILE_FORMAT}")
        if len(word) > 18:  # no vocabulary comes close; int() refuses 4,300 digits
            raise StrataError(f"--tokens-file {path}: {_where(data, m.start())}: token id "
                              f"{word[:18].decode()}... ({len(word):,} digits) is too large")
        ids.append(int(word))
    if not ids:
        raise StrataError(f"--tokens-file {path}: no token ids in the file; expected "
                          f"{TOKENS_FILE_FORMAT}")
    return ids


def check_token_ids(path: str, ids: list[int], n_vocab: int) -> None:
    """Refuse an id the model's vocabulary does not have."""
    bad = next((i for i, t in enumerate(ids) if t >= n_vocab), None)
    if bad is not None:
        raise StrataError(f"--tokens-file {path}: id number {bad + 1}: token id {ids[bad]} is "
                          f"outside 0..{n_vocab - 1}, the model's vocabulary")


def _where(data: bytes, offset: int) -> str:
    line = data.count(b"\n", 0, offset) + 1
    return f"line {line}, byte offset {offset}"


def _not_an_id(data: bytes, offset: int, word: bytes) -> str:
    """Where and what the word at `offset` is: text that is not an id, or a byte that is not
    UTF-8 text at all (then the offset is that byte's)."""
    try:
        text = word.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = offset + exc.start
        return f"{_where(data, at)}: byte 0x{data[at]:02x} is not UTF-8 text"
    shown = text if len(text) <= 20 else text[:20] + "..."
    return f"{_where(data, offset)}: {shown!r} is not a token id"


def check_prompt(prompt: str) -> None:
    """Refuse a `--prompt` that is empty, only whitespace, or not UTF-8 (bytes the shell passed
    through undecoded arrive as surrogates)."""
    if not prompt.strip():
        raise StrataError("--prompt is empty (or only whitespace); give the user message, or "
                          "use --tokens-file for a raw prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        offset = len(prompt[: exc.start].encode("utf-8"))
        code = ord(prompt[exc.start])
        what = (f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF  # surrogateescape
                else f"U+{code:04X}")
        raise StrataError(
            f"--prompt holds {what} at byte {offset}, which is not UTF-8 text; pass the message "
            "in UTF-8"
        ) from None


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
    if args.prompt is not None:
        check_prompt(args.prompt)
    if "" in args.stop:
        raise StrataError("--stop is empty; give the text the answer ends before")
    params = sampling_params(args)
    options = engine_options(args)
    flags = loan_flags()
    for w in flags.warnings_for(options):
        stderr_line(f"strata: warning: {w}")
    ids: list[int] = []
    if args.tokens_file is not None:  # read before the engine is built
        ids = read_tokens_file(args.tokens_file, tokens_file_limit(options.ctx))
        if len(ids) + args.max_new > options.ctx:
            raise StrataError(
                f"--tokens-file holds {len(ids)} tokens; with --max-new {args.max_new} that "
                f"exceeds --ctx {options.ctx}; raise --ctx"
            )
    out = _Streams()
    sampler = peak_sampler(options.device)  # CUDA with NVML: from before the engine starts
    if sampler is not None:
        sampler.start()
    try:
        loop = ServeLoop.create(options, flags, on_trace=out.line)
        write = out.text
        if args.tokens_file is not None:
            check_token_ids(args.tokens_file, ids, loop.rt.model.hp.n_vocab)
            reply = loop.complete(ids, params, args.max_new, on_text=write, stop=args.stop)
        else:
            reply = loop.chat(Conversation(), args.prompt, params, args.max_new, on_text=write,
                              stop=args.stop)
    finally:
        peak = sampler.stop() if sampler is not None else None
    out.end_text()
    stderr_line(reply.timing.line())
    if peak is not None:
        stderr_line(peak_line(peak, vram_limit_bytes(options)))
    return 0


def peak_line(peak: MemoryReading, limit_bytes: int | None) -> str:
    """`strata run: GPU peak 7,912 MiB (NVML, this process) of --vram-limit 8,192 MiB`, or how
    far past the limit it went."""
    line = f"strata run: GPU peak {peak.n_bytes / MiB:,.0f} MiB ({peak.source})"
    if limit_bytes is None:
        return line
    over = peak.n_bytes - limit_bytes
    if over > 0:
        return f"{line}, {over / MiB:,.0f} MiB over --vram-limit {limit_bytes / MiB:,.0f} MiB"
    return f"{line} of --vram-limit {limit_bytes / MiB:,.0f} MiB"
