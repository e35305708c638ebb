"""`strata info`: architecture, shapes, bytes and quant types per tensor group, and the
file's type mix per tensor kind and layer range."""

from __future__ import annotations

import argparse
from collections import defaultdict

from engine.gguf.hparams import HParams, read_hparams
from engine.gguf.reader import open_gguf
from engine.gguf.tokenizer import Tokenizer
from engine.gguf.type_mix import file_type_name, mix_lines
from engine.synth.demo import resolve_model

MIB = 1 << 20


def tensor_group(name: str, n_layer: int) -> str:
    """Which memory group a tensor belongs to (the regions the ledger will hold)."""
    if name.startswith("blk."):
        block = int(name.split(".")[1])
        if block >= n_layer:
            return "mtp.experts" if "_exps" in name else "mtp.block"
        return "experts" if "_exps" in name else "dense.blocks"  # a shared expert is dense
    if name == "output.weight":
        return "head.native"
    return "dense.embd_norm"


def _routing(hp: HParams) -> str:
    """glm4moe's router, where it is not qwen3moe's softmax."""
    if hp.gating == "softmax":
        return ""
    scale = f" x {hp.weights_scale:g}" if hp.weights_scale != 1.0 else ""
    return (f", {hp.gating}{' + selection bias' if hp.selection_bias else ''}"
            f"{', normalised' if hp.weights_norm else ''}{scale}")


def _resident_ffn(hp: HParams) -> list[str]:
    """The dense leading blocks and the shared expert: resident weights, like attention's."""
    out = []
    if hp.n_dense_lead:
        out.append(f"dense blocks  {hp.n_dense_lead} leading (ffn {hp.n_ff}), resident")
    if hp.n_expert_shared:
        out.append(f"shared expert {hp.n_expert_shared} beside the routed (ffn {hp.n_ff_shexp}), "
                   "resident")
    return out


def describe(path: str) -> str:
    mf = open_gguf(resolve_model(path))
    hp = read_hparams(mf)
    Tokenizer.from_metadata(mf.metadata).check_chat_template(mf.path.name)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    qtypes: dict[str, set[str]] = defaultdict(set)
    for t in mf.tensors.values():
        g = tensor_group(t.name, hp.n_layer)
        groups[g][0] += t.n_bytes
        groups[g][1] += 1
        qtypes[g].add(t.qtype.name)
    lines = [
        f"file          {mf.path}",
        f"architecture  {mf.arch}  ({mf.metadata.get('general.name', '')})",
        f"vocab         {hp.n_vocab:,}",
        f"layers        {hp.n_layer} main + {hp.n_nextn} MTP (nextn)",
        f"hidden        {hp.n_embd}, heads {hp.n_head} q / {hp.n_head_kv} kv x {hp.head_dim}",
        f"experts       {hp.n_expert} per layer, top-{hp.n_expert_used}, ffn {hp.n_ff_exp}"
        f"{_routing(hp)}",
        *_resident_ffn(hp),
        f"context       {hp.n_ctx_train:,} (trained), rope base {hp.rope_base:g}"
        + (f", RoPE on {hp.n_rot} of {hp.head_dim} dims" if hp.n_rot else ""),
        f"output head   {'native' if hp.has_output else 'tied to token_embd'}",
        f"file type     {file_type_name(mf) or '?'}",
        "",
        f"{'group':<18}{'tensors':>8}{'MiB':>12}  quant types",
    ]
    for g in sorted(groups):
        n_bytes, n = groups[g]
        lines.append(f"{g:<18}{n:>8}{n_bytes / MIB:>12.2f}  {', '.join(sorted(qtypes[g]))}")
    total = sum(v[0] for v in groups.values())
    lines.append(f"{'total':<18}{len(mf.tensors):>8}{total / MIB:>12.2f}")
    lines += ["", "type mix (tensor: type, and the layers where they differ)", *mix_lines(mf)]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="print a model's architecture, sizes and quant types")
    p.add_argument("model", help="a .gguf path or a preset name")
    p.set_defaults(func=lambda a: print(describe(a.model)))
