"""A file's quant-type mix: each tensor kind's types with the layers that use them (how a
user checks what they downloaded: `strata info`; llama.cpp's quantizer gives layers
different types)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from gguf import LlamaFileType

from engine.gguf.reader import ModelFile

_BLOCK = re.compile(r"blk\.(\d+)\.(.+?)(?:\.weight)?$")  # a bias keeps its suffix: attn_q.bias


def type_mix(mf: ModelFile) -> dict[str, dict[str, list[int]]]:
    """Tensor kind (`ffn_down_exps`, `token_embd`, ...) -> quant type name -> the blocks whose
    tensor of that kind has it ([] for tensors outside the blocks), in file order."""
    out: dict[str, dict[str, list[int]]] = {}
    for t in mf.tensors.values():
        m = _BLOCK.match(t.name)
        kind = m.group(2) if m else t.name.removesuffix(".weight")
        layers = out.setdefault(kind, {}).setdefault(t.qtype.name, [])
        if m:
            layers.append(int(m.group(1)))
    return out


def layers_by_value(values: Sequence[int]) -> dict[int, list[int]]:
    """Per-layer values (blob bytes) -> the layers that have each, smallest value first."""
    out: dict[int, list[int]] = {}
    for i, v in enumerate(values):
        out.setdefault(v, []).append(i)
    return dict(sorted(out.items()))


def layer_ranges(layers: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(_run(run))
        run = [i]
    if run:
        parts.append(_run(run))
    return ", ".join(parts)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def file_type_name(mf: ModelFile) -> str:
    """`general.file_type` as llama.cpp names it (`Q4_K_M`), or '' when absent or unknown."""
    value = mf.metadata.get("general.file_type")
    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


def mix_lines(mf: ModelFile) -> list[str]:
    """The type mix as aligned lines: a kind whose types differ by layer lists each type's
    layers; norms (F32 everywhere) are left out."""
    rows = []
    for kind, types in type_mix(mf).items():
        if kind.endswith("norm") and set(types) == {"F32"}:
            continue
        if len(types) == 1 or not any(types.values()):
            desc = ", ".join(types)
        else:
            desc = "; ".join(f"{q} in {layer_ranges(ls)}" for q, ls in types.items())
        rows.append((kind, desc))
    width = max([22, *(len(kind) + 2 for kind, _ in rows)])
    return [f"{kind:<{width}}{desc}" for kind, desc in rows]
