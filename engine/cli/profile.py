"""`strata profile`: record an expert profile from the routing of a prompt set."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from engine.cli.options import integer
from engine.errors import StrataError
from engine.model.loader import load_model
from engine.startup.profile_record import calibration_text, record_profile
from engine.synth.demo import resolve_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="record an expert profile (--expert-profile FILE)")
    p.add_argument("model", help="a .gguf path or a preset name")
    p.add_argument("prompts", nargs="*", help="text files to route (default: calibration text)")
    p.add_argument("--out", required=True, help="output profile path (.json)")
    p.add_argument("--max-tokens", type=integer, default=8192, help="tokens per prompt file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    texts = []
    for name in args.prompts:
        try:
            texts.append(Path(name).read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise StrataError(f"prompt file {name}: {exc.strerror}") from None
    model = load_model(resolve_model(args.model))
    profile = record_profile(model, texts or [calibration_text()], args.max_tokens)
    try:
        profile.save(args.out)
    except OSError as exc:
        raise StrataError(f"--out {args.out}: {exc.strerror}") from None
    used = int((profile.counts > 0).sum())
    top = np.sort(profile.counts.reshape(-1))[::-1]
    share = top[: max(1, len(top) // 4)].sum() / max(1, top.sum())
    print(
        f"wrote {args.out}: {profile.n_tokens:,} tokens routed, {used} of {profile.counts.size} "
        f"experts used, the top quarter takes {share:.0%} of the picks"
    )
    return 0
