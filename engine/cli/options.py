"""Argument groups shared by several sub-commands, and their conversion to EngineOptions."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import fields

from engine.backend.array_ops import KV_KINDS
from engine.config import CACHE_POLICIES, DENSE_FORMATS, EngineOptions, LoanFlags, parse_auto_int
from engine.errors import FlagError
from engine.request.sampler import SamplingParams

# ASCII only: int() and float() also take '1_000', ' 7 ' and Unicode digits such as '١٢'
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
MAX_INTEGER_DIGITS = 20  # 2**64 - 1 (a seed) has 20
MAX_NUMBER_CHARS = 40


def integer(text: str) -> int:
    """argparse type: an integer written in ASCII digits, with an optional sign."""
    if not _INTEGER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not an integer in ASCII digits 0-9")
    if len(text.lstrip("+-")) > MAX_INTEGER_DIGITS:
        raise argparse.ArgumentTypeError(
            f"{_shown(text)} ({len(text):,} digits) is too large for any option")
    return int(text)


def number(text: str) -> float:
    """argparse type: a finite decimal number in ASCII ('0.7', '1e-3'); never nan or inf."""
    if len(text) > MAX_NUMBER_CHARS or not _NUMBER.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{_shown(text)} is not a decimal number in ASCII digits such as 0.7")
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is too large (not a finite number)")
    return value


def _shown(text: str) -> str:
    return repr(text if len(text) <= 24 else text[:24] + "...")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="a .gguf path, or a preset name such as 'demo'")
    p.add_argument("--ctx", type=integer, default=8192, help="KV cache cells (default 8192)")
    p.add_argument("--kv", choices=KV_KINDS, default="f16", help="KV cache storage type")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model, device, memory plan, prompt geometry, MTP and serve options."""
    add_model_args(p)
    g = p.add_argument_group("device and memory")
    g.add_argument("--device", default="auto",
                   help="auto, sim, sim:SIZE (e.g. sim:8GiB), cuda or cuda:N (default auto)")
    g.add_argument("--expert-cache", default="auto", help="expert-cache slots: auto or N")
    g.add_argument("--expert-profile", help="expert profile JSON (see `strata profile`)")
    g.add_argument("--vram-segment-mib", type=integer, help="ledger segment size in MiB")
    g.add_argument("--vram-reserve-mib", type=integer, default=0, help="MiB kept free")
    g.add_argument("--vram-elastic", action="store_true",
                   help="back the expert cache and decode-only regions with elastic segments")
    g.add_argument("--vram-limit", help="plan as if the device had only SIZE (CUDA)")
    g.add_argument("--cache-policy", choices=CACHE_POLICIES, default="auto",
                   help="'adaptive': decode steps promote experts they miss often and lately "
                        "into the expert cache; 'static': the cache keeps its profile fill; "
                        "'auto': adaptive on CUDA, static on the simulated device")
    g.add_argument("--prefill", default="auto", help="prompt chunk: auto or N tokens")
    g.add_argument("--no-borrow", action="store_true",
                   help="never borrow cache slots for the prompt path (own its buffers)")
    g.add_argument("--no-token-graph", action="store_true", help="run decode steps eagerly")
    g.add_argument("--dense", choices=DENSE_FORMATS, default="auto",
                   help="dense linear weights on the device: 'quant' keeps the file's blocks "
                        "(read by the dequantizing kernels), 'float' decodes them; 'auto': "
                        "quant on CUDA, float on the simulated device")
    s = p.add_argument_group("speculative decoding and serving")
    s.add_argument("--mtp", action="store_true", help="use the model's MTP (nextn) layer")
    s.add_argument("--spec", type=integer, default=0, help="speculative window T (2..8; 0 off)")
    s.add_argument("--cache-lend", action="store_true",
                   help="with --mtp --spec: lend the MTP experts and draft head to the expert "
                        "cache while the drafting policy decodes plain, back before a draft "
                        "(trace lines 'strata lend:'; default: off, they stay resident; "
                        "the chat app turns it on unless --plain)")
    s.add_argument("--spec-always", action="store_true",
                   help="draft on every step (default: only while drafted steps are measured "
                        "faster per token than plain ones; sampled requests always draft)")
    s.add_argument("--draft-vocab", type=integer, default=0, help="draft head rows (0: all)")
    s.add_argument("--mtp-experts", default="auto",
                   help="with --mtp: nextn-block experts kept on the device, auto or N (auto: "
                        "all where they fit, else fewer, the rest uploaded when a draft "
                        "routes to them)")
    s.add_argument("--serve", action="store_true", help="the serialized serve loop (loans)")
    s.add_argument("--batch-slots", type=integer, default=1, help="concurrent requests (1)")
    s.add_argument("--prefill-head-alias", action="store_true",
                   help="alias the prompt path onto the output head (refused with loans)")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """EngineOptions from parsed arguments (raises FlagError on bad values)."""
    empty = [f"{flag} is empty; give {what}" for flag, value, what in (
        ("--model", args.model, "a .gguf path or a preset name such as 'demo'"),
        ("--vram-limit", args.vram_limit, "a size such as 8GiB"),
        ("--expert-profile", args.expert_profile, "the path of a profile (see `strata profile`)"),
    ) if value is not None and not value.strip()]
    if empty:
        raise FlagError(empty)
    return EngineOptions(
        model=args.model, device=args.device, ctx=args.ctx, kv=args.kv,
        prefill=parse_auto_int(str(args.prefill), "--prefill"),
        expert_cache=parse_auto_int(str(args.expert_cache), "--expert-cache"),
        expert_profile=args.expert_profile, vram_segment_mib=args.vram_segment_mib,
        vram_reserve_mib=args.vram_reserve_mib, vram_elastic=args.vram_elastic,
        vram_limit=args.vram_limit, serve=args.serve, mtp=args.mtp, spec=args.spec,
        spec_always=args.spec_always,
        draft_vocab=args.draft_vocab,
        mtp_experts=parse_auto_int(str(args.mtp_experts), "--mtp-experts"), no_token_graph=args.no_token_graph, dense=args.dense,
        cache_lend=args.cache_lend, cache_policy=args.cache_policy,
        no_borrow=args.no_borrow, batch_slots=args.batch_slots,
        prefill_head_alias=args.prefill_head_alias,
    )


def options_argv(options: EngineOptions) -> list[str]:
    """The command-line options that give back `options` (`engine_options` inverted): what
    a benchmark passes to the `strata run` and `strata serve` it starts."""
    argv: list[str] = []
    for f in fields(options):
        value = getattr(options, f.name)
        flag = "--" + f.name.replace("_", "-")
        if value == f.default or value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def loan_flags() -> LoanFlags:
    """The STRATA_PREFILL_* flags from the environment (raises FlagError on bad values)."""
    return LoanFlags.from_env()


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=number, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=integer, default=40)
    p.add_argument("--top-p", type=number, default=0.95)
    p.add_argument("--seed", type=integer, default=0)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
