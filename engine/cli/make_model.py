"""`strata make-model`: write a deterministic synthetic qwen3moe or glm4moe GGUF."""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path

from engine.cli.options import integer
from engine.errors import FlagError, StrataError
from engine.gguf.reader import SUPPORTED_QTYPES
from engine.memory.sizes import GiB
from engine.synth.demo import stderr_progress
from engine.synth.mixes import MIXES
from engine.synth.model import GROUPS, PRESETS, write_model

SHAPE_FLAGS = {
    "layers": "n_layer",
    "experts": "n_expert",
    "top_k": "n_expert_used",
    "hidden": "n_embd",
    "heads": "n_head",
    "kv_heads": "n_head_kv",
    "head_dim": "head_dim",
    "ff": "n_ff_exp",
    "vocab": "n_vocab",
    "mtp": "n_nextn",
    "ctx": "n_ctx",
    "seed": "seed",
    # glm4moe presets (tiny-glm, glm4.5-air): their dense and shared FFNs
    "dense_layers": "n_dense_lead",
    "dense_ff": "n_ff",
    "shared_experts": "n_expert_shared",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a synthetic qwen3moe or glm4moe GGUF (--preset)")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--preset", choices=sorted(PRESETS), default="random-demo")
    for flag in SHAPE_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=integer, default=None)
    p.add_argument("--tied-output", action="store_true", help="no output.weight (tied head)")
    p.add_argument(
        "--qtype",
        action="append",
        default=[],
        metavar="GROUP=TYPE",
        help=f"quant type per tensor group ({', '.join(GROUPS)}, or all), e.g. experts=Q4_K",
    )
    p.add_argument("--mix", choices=sorted(MIXES), default=None, type=str.lower,
                   help="the types llama.cpp's quantizer gives each tensor under this mix, layer "
                        "by layer (e.g. q4_k_m: Q6_K on half the ffn_down_exps, Q4_K elsewhere)")
    p.set_defaults(func=run)


def check_disk(out: str, n_bytes: int) -> None:
    """Refuse before writing a file the disk cannot hold."""
    folder = Path(out).resolve().parent
    while not folder.exists():  # write_model makes the missing folders
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if n_bytes > free:
        raise StrataError(
            f"{out}: the model needs {n_bytes / GiB:,.1f} GiB and {folder} has "
            f"{free / GiB:,.1f} GiB free; give smaller shapes (--layers, --experts, --ff, --hidden)"
        )


def run(args: argparse.Namespace) -> int:
    spec = PRESETS[args.preset]
    changes = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items()
               if getattr(args, flag) is not None}
    spec = replace(spec, **changes, tied_output=args.tied_output or spec.tied_output,
                   mix=args.mix or spec.mix)
    supported = {q.name for q in SUPPORTED_QTYPES}
    for item in args.qtype:
        group, _, qtype = item.partition("=")
        if group not in (*GROUPS, "all") or qtype.upper() not in supported:
            raise StrataError(
                f"--qtype {item}: expected GROUP=TYPE with GROUP in {', '.join(GROUPS)}, all "
                f"and TYPE in {', '.join(sorted(supported))}"
            )
        spec = spec.with_qtype(group, qtype.upper())
    problems = spec.problems({field: f"--{flag.replace('_', '-')}"
                              for flag, field in {**SHAPE_FLAGS, "mix": "mix"}.items()})
    if problems:
        raise FlagError([f"make-model --preset {args.preset}: {problems[0]}", *problems[1:]])
    check_disk(args.out, spec.tensor_bytes())
    try:
        path = write_model(args.out, spec, stderr_progress(f"writing {args.out}"))
    except OSError as exc:
        raise StrataError(f"{args.out}: {exc.strerror}") from None
    print(f"wrote {path} ({path.stat().st_size / (1 << 20):.1f} MiB)")
    return 0
