"""`strata strip-mtp IN OUT`: the model without its MTP block, for llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.errors import StrataError
from engine.gguf.reader import open_gguf
from engine.gguf.strip_mtp import strip_mtp
from engine.synth.demo import resolve_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "strip-mtp",
        help="copy a model without its MTP (nextn) block (llama.cpp's qwen3moe refuses one)",
    )
    p.add_argument("model", help="a .gguf path or 'demo'")
    p.add_argument("out", help="where to write the copy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    src = resolve_model(args.model)
    open_gguf(src)  # the engine's checks first: a bad file is one line
    out = Path(args.out)
    if out.resolve() == src.resolve():
        raise StrataError(f"strip-mtp: {out} is the input file; give another path")
    n = strip_mtp(src, out)
    print(f"wrote {out} ({out.stat().st_size / (1 << 20):.1f} MiB) without {n} MTP block(s)")
    return 0
