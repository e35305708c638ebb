"""Weights checked at load for values no trained model holds: NaN or infinity in a float tensor
or in a quantized block's scale, and float weights past float16's range.

A NaN in a norm, a router or a block scale does not fail anywhere later: every activation after
it turns NaN and the reply comes out as NUL bytes. llama.cpp checks only when asked (its
check_tensors option); we refuse such a file in one line naming the tensor. The bound for
float tensors is float16's largest finite value, ±65,504: on the GPU dense weights are
float16, so a larger one is infinity there (and a norm of 1e30 overflows float32 activations
on the CPU a few layers on).

What is read, so the check stays cheap (Qwen3-30B-A3B's shapes, 17 GiB: 0.3 s with the file
in the page cache, 1.9 s from a cold one, on a 2-core VM):
  - float tensors (F32, F16, BF16, F64): every element;
  - block-quantized tensors: the float16 scale fields (`d`, and `dmin` or `m`) of every block;
  - the routed experts (by far most of a MoE file): the same, on SAMPLE_ROWS rows spread
    evenly over each tensor, so startup does not read gigabytes the expert cache reads later.
Integer tensors hold no scale and are not read.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.errors import GGUFError
from engine.gguf import names
from engine.gguf.reader import ModelFile, TensorView

FLOAT16_MAX = 65504.0
SAMPLE_ROWS = 64  # rows of each routed-expert tensor whose scales are read (spread evenly)
CHUNK_ELEMENTS = 1 << 24  # elements converted at a time (a BF16 or F16 table to float32)

# Byte offsets of the float16 scale fields of one block, from ggml's block_* structs
# (ggml-common.h): `d` first, then `m` or `dmin` where the type has one. Held against
# `gguf.quants`' decoders in tests/test_weight_values.py. IQ1_M spreads its scale over the top
# nibbles of four words and MXFP4 stores a power-of-two exponent byte: see `_scale_bits`.
SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ1_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}
IQ1_M_SCALES = 48  # byte offset of IQ1_M's four uint16 scale words
MXFP4_NAN = 0xFF  # the E8M0 exponent byte that means NaN
_F16_EXPONENT = 0x7C00  # all exponent bits set: infinity or NaN


def check_values(mf: ModelFile) -> None:
    """Raise a one-line GGUFError on the first tensor of `mf` holding NaN or infinity (in its
    values or its block scales) or a float weight beyond ±FLOAT16_MAX."""
    dense = [t for t in mf.tensors.values() if not _is_expert(t.name)]
    experts = [t for t in mf.tensors.values() if _is_expert(t.name)]
    for t in dense:
        _check(mf, t, sampled=False)
    with _random_access(mf.data):
        for t in experts:
            _check(mf, t, sampled=True)


def _check(mf: ModelFile, t: TensorView, sampled: bool) -> None:
    problem = tensor_problem(t, sampled=sampled)
    if problem:
        raise GGUFError(f"{mf.path.name}: tensor '{t.name}' ({t.qtype.name}) {problem}; "
                        "the file is corrupt, download it again")


@contextmanager
def _random_access(data: np.ndarray | None) -> Iterator[None]:
    """Sampled rows read without the kernel's read-around: each page fault on a memory map
    otherwise reads `read_ahead_kb` around it (8 MiB on some hosts), and SAMPLE_ROWS rows of
    every expert tensor would read most of the file (35 s instead of 1.5 s, measured). Normal
    read-ahead is back afterwards (the expert cache reads blobs in sequence)."""
    mm = getattr(data, "base", None)
    advise = isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_RANDOM")
    if advise:
        mm.madvise(mmap.MADV_RANDOM)  # type: ignore[union-attr]
    try:
        yield
    finally:
        if advise:
            mm.madvise(mmap.MADV_NORMAL)  # type: ignore[union-attr]


def tensor_problem(t: TensorView, sampled: bool = False) -> str:
    """What is wrong with the values of `t` in words ('holds nan at element 17'), or ''.
    `sampled`: read SAMPLE_ROWS rows spread over the tensor, not all of them."""
    rows = _rows(t)  # [n_rows, row_items]
    picked = np.arange(len(rows))
    if sampled and len(rows) > SAMPLE_ROWS:
        picked = np.unique(np.linspace(0, len(rows) - 1, SAMPLE_ROWS).round().astype(np.int64))
    if t.qtype in (Q.F32, Q.F16, Q.F64, Q.BF16):
        for start, part in _chunks(rows, picked):
            x = _floats(part, t.qtype)  # [n, row_elements]
            bad = ~(np.abs(x) <= FLOAT16_MAX)  # NaN fails the comparison
            if bad.any():
                r, c = np.argwhere(bad)[0]
                where = f"element {int(picked[start + r]) * x.shape[1] + int(c):,}"
                return _value_problem(float(x[r, c]), where)
        return ""
    if t.qtype not in SCALE_OFFSETS and t.qtype not in (Q.IQ1_M, Q.MXFP4):
        return ""  # integers (I8..I64): no scale
    block_bytes = GGML_QUANT_SIZES[t.qtype][1]
    for start, part in _chunks(rows, picked):
        blocks = part.reshape(len(part), -1, block_bytes)  # [n, blocks a row, block_bytes]
        bad = _bad_scales(blocks, t.qtype)  # [n, blocks a row]
        if bad.any():
            r, b = np.argwhere(bad)[0]
            return (f"has a block scale that is NaN or infinite (block {int(b):,} of row "
                    f"{int(picked[start + r]):,})")
    return ""


def _is_expert(name: str) -> bool:
    """A routed expert tensor (`blk.N.ffn_*_exps.weight`)."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in names.EXPERT_TENSORS


def _rows(t: TensorView) -> np.ndarray:
    """The payload as rows: [n_rows, elements] for float types (BF16: uint16 bits), else
    [n_rows, row_bytes] uint8; a view of the memory map."""
    raw = t.raw
    if t.qtype == Q.BF16:  # the container gives BF16 as bytes
        raw = raw.view(np.uint16)
    return raw.reshape(-1, raw.shape[-1]) if raw.ndim else raw.reshape(1, 1)


def _chunks(rows: np.ndarray, picked: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first index into `picked`, rows[picked[...]]) in parts of about CHUNK_ELEMENTS."""
    step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
    every = len(picked) == len(rows)
    for start in range(0, len(picked), step):
        yield start, (rows[start : start + step] if every else rows[picked[start : start + step]])


def _floats(part: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.BF16:  # bfloat16 is the top half of a float32
        return (part.astype(np.uint32) << 16).view(np.float32)
    return part


def _value_problem(value: float, where: str) -> str:
    if np.isnan(value) or np.isinf(value):
        return f"holds {value} at {where}; weights must be finite numbers"
    return (f"holds {value:.6g} at {where}, beyond float16's range of ±{FLOAT16_MAX:,.0f} "
            "(dense weights are float16 on the GPU)")


def _bad_scales(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """blocks uint8 [n, k, block_bytes] -> bool [n, k]: a scale is NaN or infinite."""
    if qtype == Q.MXFP4:
        return blocks[..., 0] == MXFP4_NAN
    words = blocks.view(np.uint16)  # [n, k, block_bytes / 2]: every block size here is even
    if qtype == Q.IQ1_M:
        sc = words[..., IQ1_M_SCALES // 2 : IQ1_M_SCALES // 2 + 4]  # [n, k, 4]
        bits = ((sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0x00F0)
                | ((sc[..., 2] >> 4) & 0x0F00) | (sc[..., 3] & 0xF000))
        return (bits & _F16_EXPONENT) == _F16_EXPONENT
    bad = np.zeros(blocks.shape[:2], dtype=bool)
    for offset in SCALE_OFFSETS[qtype]:
        bad |= (words[..., offset // 2] & _F16_EXPONENT) == _F16_EXPONENT
    return bad
