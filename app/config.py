"""The app's configuration: `ChatConfig` and the chat command's options and defaults.

`chat_config` turns the command line, the environment and the settings file (`app.settings`)
into a `ChatConfig`; bad options or STRATA_PREFILL_* values are one line (a `StrataError`). What
the command line gives and STRATA_PREFILL_* variables win over the file; a file that cannot be
used is moved aside and the app says so (`settings_note`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from app.settings import Settings, read_settings, settings_path
from engine.cli.options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    integer,
    loan_flags,
)
from engine.config import EngineOptions, LoanFlags
from engine.errors import StrataError
from engine.request.conversation import Sampling
from engine.request.sampler import SamplingParams
from engine.server.config import API_KEY_ENV
from engine.synth.demo import is_model_name
from engine.synth.model import PRESETS


@dataclass(frozen=True)
class ChatConfig:
    """Everything the app needs to start: engine options, loan flags, sampling (of new
    conversations), and the settings kept between runs.

    `default_flags`: where `flags` are the settings file's, the flags without it (the
    environment's or the app's). The engine starts with them and is asked for `flags` once
    loaded; a refusal keeps them, and "reset settings" returns to them. None when `flags` are
    those. `settings_path` None: settings are not written (tests, scenes).
    """

    options: EngineOptions
    flags: LoanFlags
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 256
    connect: str | None = None  # a `strata serve` URL: the app is its client (options unused)
    api_key: str | None = None  # the server's bearer token
    settings: Settings = field(default_factory=Settings)
    settings_path: Path | None = None
    settings_note: str = ""  # the settings file could not be used: why, and where it went
    default_flags: LoanFlags | None = None


# The app exists to show the loan: unless told otherwise it starts on the serialized serve
# path with elastic segments and MTP drafts (T = 2) whose memory serves the expert cache over
# plain spans (--cache-lend), and with every loan flag on when no STRATA_PREFILL_* variable is
# set (set any of them, or use the flags panel, to change that). --plain: none of it.
APP_DEFAULTS = {"serve": True, "vram_elastic": True, "mtp": True, "spec": 2, "cache_lend": True}
APP_FLAGS = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                           retain_startup_chunk=True, repeat_loan=True)


# the options the settings file also holds: None when the command line does not give them
_SAMPLING_DESTS = ("temperature", "top_k", "top_p", "seed", "max_new")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new", type=integer, default=256,
                   help="tokens per answer (default 256)")
    p.add_argument_group(
        "settings",
        "The theme, the dashboard, what a new conversation takes (a system prompt, and the "
        "sampling of --temperature, --top-k, --top-p, --seed, --max-new) and the loan flags are "
        f"kept in {settings_path()} "
        "(STRATA_CONFIG_DIR sets its directory). Those options given here, and STRATA_PREFILL_* "
        "variables, win over the file for this run; --plain and --connect ignore its flags.")
    p.add_argument("--plain", action="store_true",
                   help="start without the loan defaults (no --serve/--mtp, flags from the env)")
    p.add_argument("--connect", metavar="URL",
                   help="chat with a running `strata serve` (such as http://127.0.0.1:8080) "
                        "instead of an engine in this process; its engine options and flags "
                        "are the server's")
    p.add_argument("--api-key", help=f"the server's bearer token with --connect (default: "
                                     f"${API_KEY_ENV} when set)")
    p.set_defaults(**APP_DEFAULTS, **dict.fromkeys(_SAMPLING_DESTS))


def chat_config(args: argparse.Namespace) -> ChatConfig:
    """Validate the command line and the environment, read the settings file; raises
    StrataError (one line) for the command line or the environment."""
    if args.max_new is not None and args.max_new < 1:
        raise StrataError(f"--max-new {args.max_new} must be at least 1")
    path = settings_path()
    settings, note = read_settings(path)
    sampling = _sampling(args, settings.sampling)
    kept = {"settings": settings, "settings_path": path, "settings_note": note}
    if args.connect is not None:
        return _remote_config(args, sampling, kept)
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
    default_flags = None
    if not args.plain and not any(k.startswith("STRATA_PREFILL_") for k in os.environ):
        flags = APP_FLAGS if options.mtp else LoanFlags.make(
            elastic_loan=True, retain_startup_chunk=True, repeat_loan=True)
        if settings.flags is not None and settings.flags != flags:
            flags, default_flags = settings.flags, flags
    for warning in flags.warnings_for(options):
        sys.stderr.write(f"strata: warning: {warning}\n")
    return ChatConfig(options, flags, sampling.params, sampling.max_tokens,
                      default_flags=default_flags, **kept)


def _sampling(args: argparse.Namespace, saved: Sampling) -> Sampling:
    """The sampling of new conversations: the command line's values over the file's."""
    p = saved.params
    given = {d: getattr(args, d) for d in _SAMPLING_DESTS if getattr(args, d) is not None}
    params = SamplingParams(
        temperature=given.get("temperature", p.temperature), top_k=given.get("top_k", p.top_k),
        top_p=given.get("top_p", p.top_p), seed=given.get("seed", p.seed))
    return Sampling(params, given.get("max_new", saved.max_tokens))


def _remote_config(args: argparse.Namespace, sampling: Sampling,
                   kept: dict[str, Any]) -> ChatConfig:
    """--connect: the server's URL and key; sampling and --max-new stay the app's."""
    url = args.connect.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise StrataError(f"--connect {args.connect}: give the server's URL, such as "
                          "http://127.0.0.1:8080")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    return ChatConfig(engine_options(args), LoanFlags(), sampling.params, sampling.max_tokens,
                      connect=url, api_key=key or None, **kept)


def _has_mtp(path: str) -> bool:
    """Whether a GGUF announces an MTP (nextn) layer (metadata only, no weights read)."""
    from engine.gguf.reader import open_gguf

    try:
        return bool(open_gguf(path).key("nextn_predict_layers", 0))
    except StrataError:
        return False  # the engine reports the bad file with its own one-line error
