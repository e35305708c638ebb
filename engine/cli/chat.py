"""`strata chat`: the Textual chat app on one engine (options here, flags from the environment).

The app itself lives in `app/`; this module only turns the command line into a `ChatConfig`
and launches it. Bad options or STRATA_PREFILL_* values are one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine.cli.options import add_model_args, add_sampling_args, sampling_params
from engine.config import EngineOptions, LoanFlags, parse_auto_int
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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineOptions field as a command-line option."""
    add_model_args(p)
    p.add_argument("--device", default="auto", help="auto, cpu, sim:8GiB or cuda:N")
    p.add_argument("--prefill", default="auto", help="'auto' or a fixed chunk of N tokens")
    p.add_argument("--expert-cache", default="auto", help="'auto' or a slot count")
    p.add_argument("--expert-profile", help="expert-usage profile file (fills the cache)")
    p.add_argument("--vram-segment-mib", type=int, help="elastic segment size in MiB")
    p.add_argument("--vram-reserve-mib", type=int, default=0, help="MiB kept free")
    p.add_argument("--vram-elastic", action="store_true", help="segmented expert cache")
    p.add_argument("--vram-limit", help="device budget, e.g. 8GiB")
    p.add_argument("--serve", action="store_true", help="the serialized serve path (loans)")
    p.add_argument("--mtp", action="store_true", help="load the MTP (nextn) layer")
    p.add_argument("--spec", type=int, default=0, help="speculative window T (0 off, 2..8)")
    p.add_argument("--draft-vocab", type=int, default=0, help="draft-head rows (0: all)")
    p.add_argument("--no-token-graph", action="store_true", help="run decode eagerly")
    p.add_argument("--no-borrow", action="store_true", help="never borrow the cache tail")
    p.add_argument("--batch-slots", type=int, default=1, help="concurrent sequences")
    p.add_argument("--prefill-head-alias", action="store_true", help="alias the head in prefill")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new", type=int, default=256, help="tokens per answer (default 256)")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(
        model=args.model,
        device=args.device,
        ctx=args.ctx,
        kv=args.kv,
        prefill=parse_auto_int(args.prefill, "--prefill"),
        expert_cache=parse_auto_int(args.expert_cache, "--expert-cache"),
        expert_profile=args.expert_profile,
        vram_segment_mib=args.vram_segment_mib,
        vram_reserve_mib=args.vram_reserve_mib,
        vram_elastic=args.vram_elastic,
        vram_limit=args.vram_limit,
        serve=args.serve,
        mtp=args.mtp,
        spec=args.spec,
        draft_vocab=args.draft_vocab,
        no_token_graph=args.no_token_graph,
        no_borrow=args.no_borrow,
        batch_slots=args.batch_slots,
        prefill_head_alias=args.prefill_head_alias,
    )


def chat_config(args: argparse.Namespace) -> ChatConfig:
    """Validate the command line and the environment; raises StrataError (one line)."""
    if args.max_new < 1:
        raise StrataError(f"--max-new {args.max_new} must be at least 1")
    options = engine_options(args)
    if options.model not in PRESETS and not Path(options.model).is_file():
        raise StrataError(
            f"--model {options.model}: no such file (or preset: {', '.join(PRESETS)})"
        )
    flags = LoanFlags.from_env()
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
