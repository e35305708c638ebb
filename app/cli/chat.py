"""`strata chat`: the Textual chat app on one engine (options here, flags from the environment).

The app itself lives in `app/`; this module only turns the command line into a `ChatConfig`
and launches it. Bad options or STRATA_PREFILL_* values are one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine.cli.options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    loan_flags,
    sampling_params,
)
from engine.config import EngineOptions, LoanFlags
from engine.errors import StrataError
from engine.sampler import SamplingParams
from engine.synth.model import PRESETS


@dataclass(frozen=True)
class ChatConfig:
    """Everything the app needs to start: engine options, loan flags, sampling."""

    options: EngineOptions
    flags: LoanFlags
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 256


def add_chat_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new", type=int, default=256, help="tokens per answer (default 256)")


def chat_config(args: argparse.Namespace) -> ChatConfig:
    """Validate the command line and the environment; raises StrataError (one line)."""
    if args.max_new < 1:
        raise StrataError(f"--max-new {args.max_new} must be at least 1")
    options = engine_options(args)
    if options.model not in PRESETS and not Path(options.model).is_file():
        raise StrataError(
            f"--model {options.model}: no such file (or preset: {', '.join(PRESETS)})"
        )
    flags = loan_flags()
    for warning in flags.warnings:
        sys.stderr.write(f"strata: warning: {warning}\n")
    return ChatConfig(options, flags, sampling_params(args), args.max_new)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="the chat app: streams answers and draws the VRAM loan")
    add_chat_args(p)
    p.set_defaults(func=chat)


def chat(args: argparse.Namespace) -> int:
    config = chat_config(args)
    from app.main import launch  # the app (Textual) loads only for this command

    return launch(config)
