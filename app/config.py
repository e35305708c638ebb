"""The app's configuration: `ChatConfig` and the chat command's options and defaults.

`chat_config` turns the command line and the environment into a `ChatConfig`; bad options or
STRATA_PREFILL_* values are one line (a `StrataError`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from engine.cli.options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    integer,
    loan_flags,
    sampling_params,
)
from engine.config import EngineOptions, LoanFlags
from engine.errors import StrataError
from engine.sampler import SamplingParams
from engine.server.config import API_KEY_ENV
from engine.synth.demo import is_model_name
from engine.synth.model import PRESETS


@dataclass(frozen=True)
class ChatConfig:
    """Everything the app needs to start: engine options, loan flags, sampling."""

    options: EngineOptions
    flags: LoanFlags
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 256
    connect: str | None = None  # a `strata serve` URL: the app is its client (options unused)
    api_key: str | None = None  # the server's bearer token


# The app exists to show the loan: unless told otherwise it starts on the serialized serve
# path with elastic segments and MTP drafts (T = 2) whose memory serves the expert cache over
# plain spans (--cache-lend), and with every loan flag on when no STRATA_PREFILL_* variable is
# set (set any of them, or use the flags panel, to change that). --plain: none of it.
APP_DEFAULTS = {"serve": True, "vram_elastic": True, "mtp": True, "spec": 2, "cache_lend": True}
APP_FLAGS = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                           retain_startup_chunk=True, repeat_loan=True)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new", type=integer, default=256,
                   help="tokens per answer (default 256)")
    p.add_argument("--plain", action="store_true",
                   help="start without the loan defaults (no --serve/--mtp, flags from the env)")
    p.add_argument("--connect", metavar="URL",
                   help="chat with a running `strata serve` (such as http://127.0.0.1:8080) "
                        "instead of an engine in this process; its engine options and flags "
                        "are the server's")
    p.add_argument("--api-key", help=f"the server's bearer token with --connect (default: "
                                     f"${API_KEY_ENV} when set)")
    p.set_defaults(**APP_DEFAULTS)


def chat_config(args: argparse.Namespace) -> ChatConfig:
    """Validate the command line and the environment; raises StrataError (one line)."""
    if args.max_new < 1:
        raise StrataError(f"--max-new {args.max_new} must be at least 1")
    if args.connect is not None:
        return _remote_config(args)
    if args.plain:
        for name in APP_DEFAULTS:
            setattr(args, name, 0 if name == "spec" else False)
    elif not is_model_name(args.model) and Path(args.model).is_file() and not _has_mtp(args.model):
        args.mtp, args.spec = False, 0  # a model without an MTP layer: no drafts to loan
    options = engine_options(args)
    if not is_model_name(options.model) and not Path(options.model).is_file():
        raise StrataError(
            f"--model {options.model}: no such file (or model name: demo, {', '.join(PRESETS)})"
        )
    flags = loan_flags()
    if not args.plain and not any(k.startswith("STRATA_PREFILL_") for k in os.environ):
        flags = APP_FLAGS if options.mtp else LoanFlags.make(
            elastic_loan=True, retain_startup_chunk=True, repeat_loan=True)
    for warning in flags.warnings_for(options):
        sys.stderr.write(f"strata: warning: {warning}\n")
    return ChatConfig(options, flags, sampling_params(args), args.max_new)


def _remote_config(args: argparse.Namespace) -> ChatConfig:
    """--connect: the server's URL and key; sampling and --max-new stay the app's."""
    url = args.connect.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise StrataError(f"--connect {args.connect}: give the server's URL, such as "
                          "http://127.0.0.1:8080")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    return ChatConfig(engine_options(args), LoanFlags(), sampling_params(args), args.max_new,
                      connect=url, api_key=key or None)


def _has_mtp(path: str) -> bool:
    """Whether a GGUF announces an MTP (nextn) layer (metadata only, no weights read)."""
    from engine.gguf.reader import open_gguf

    try:
        return bool(open_gguf(path).key("nextn_predict_layers", 0))
    except StrataError:
        return False  # the engine reports the bad file with its own one-line error
