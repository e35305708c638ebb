"""Random but valid quantized blocks for synthetic models.

`gguf.quants` can quantize only some types, and quantizing tens of GB of random floats would
take minutes; instead we draw the block bytes directly (every byte pattern of these formats
decodes to finite values once the f16 scale fields are set) and set the scale fields so the
decoded weights have the requested standard deviation. Decoding stays `gguf.quants`' job.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

# f16 fields of one block as (byte offset, multiple of the base scale d). Fields that act as
# minimums (Q4_1 m, Q*_K dmin) get a negative/large multiple so the decoded mean is near zero.
SCALE_FIELDS: dict[Q, tuple[tuple[int, float], ...]] = {
    Q.Q8_0: ((0, 1.0),),
    Q.Q4_0: ((0, 1.0),),
    Q.Q4_1: ((0, 1.0), (2, -7.5)),
    Q.Q5_0: ((0, 1.0),),
    Q.Q5_1: ((0, 1.0), (2, -15.5)),
    Q.Q4_K: ((0, 1.0), (2, 7.5)),
    Q.Q5_K: ((0, 1.0), (2, 15.5)),
    Q.Q6_K: ((208, 1.0),),
    Q.IQ4_XS: ((0, 1.0),),
    Q.IQ3_XXS: ((0, 1.0),),
    Q.Q2_K: ((80, 1.0), (82, 1.5)),  # d, dmin; 1.5: the mean 2-bit code, as Q4_K's 7.5
    Q.Q3_K: ((108, 1.0),),
    Q.IQ2_XXS: ((0, 1.0),),
    Q.IQ2_XS: ((0, 1.0),),
    Q.IQ2_S: ((0, 1.0),),
    Q.IQ3_S: ((0, 1.0),),
    Q.IQ1_S: ((0, 1.0),),
    Q.IQ4_NL: ((0, 1.0),),
    # no f16 field of their own: `_set_scale` writes them
    Q.IQ1_M: (),  # d's four nibbles are the top nibbles of the u16 scale words at 48..55
    Q.MXFP4: (),  # an E8M0 exponent byte at 0: the scale is a power of two
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
_PROBE_ROWS = 64


def _blocks(rng: np.random.Generator, qtype: Q, n_rows: int, n_cols: int, d: float,
            centered: bool = False) -> np.ndarray:
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * (n_cols // block)
    raw = rng.integers(0, 256, size=(n_blocks, type_bytes), dtype=np.uint8)
    if centered:  # before the scale fields: it may rewrite their bytes too (they are set next)
        _center(raw, qtype)
    set_scales(raw, qtype, d)
    return raw.reshape(n_rows, -1)  # [rows, row_bytes]


def set_scales(raw: np.ndarray, qtype: Q, d: float | np.ndarray) -> None:
    """Write the base scale `d` (one, or one per block) into blocks [n_blocks, type_bytes]:
    the f16 fields of `SCALE_FIELDS`, and the types that do not store it as one f16 field."""
    d = np.broadcast_to(np.asarray(d, dtype=np.float64), (len(raw),))  # [n_blocks]
    for offset, mult in SCALE_FIELDS[qtype]:
        raw[:, offset : offset + 2] = (d * mult).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:  # nibble w of d's f16 bits: the high nibble of byte 49 + 2w
        h = d.astype(np.float16).view(np.uint16)  # [n_blocks]
        for w in range(4):
            nibble = ((h >> np.uint16(4 * w)) & np.uint16(0xF)).astype(np.uint8)
            raw[:, 49 + 2 * w] = (raw[:, 49 + 2 * w] & 0x0F) | (nibble << 4)
    elif qtype == Q.MXFP4:  # E8M0: 2^(e - 128) times the doubled E2M1 values
        raw[:, 0] = np.clip(128 + np.round(np.log2(d)), 1, 254).astype(np.uint8)


def _byte_map(fix: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """A 256-entry uint8 table: byte b -> fix(b), for `np.take` over whole arrays."""
    return fix(np.arange(256, dtype=np.uint16)).astype(np.uint8)


# Q4_0: a nibble q = 0 becomes 8 (value 0), in both nibbles of a byte
_Q4_0_CENTER = _byte_map(lambda b: np.where(b & 15 == 0, 8, b & 15) | (np.where(b >> 4 == 0, 8, b >> 4) << 4))


def _center(raw: np.ndarray, qtype: Q) -> None:
    """Make random blocks [n_blocks, type_bytes] decode to values symmetric around zero.

    Uniform random codes are only nearly centered: Q4_0's d * (q - 8) for q in 0..15 has mean
    -d/2, Q8_0's int8 codes mean -1/2, and a Q4_K/Q5_K sub-block's mean is d * 7.5 * (scale -
    min) for random 6-bit scale and min. Those biases are the same sign in every row, so an
    expert's outputs share a direction that builds up through the residual stream and the
    router follows it: deep synthetic models sent most tokens to a few experts (3 layers of
    Qwen3-30B-A3B shapes: 37% of tokens to one of 128 experts at the third). Centered: Q4_0
    codes 1..15 (values -7..7), Q8_0 codes -127..127, Q4_K/Q5_K min = scale per sub-block.
    Other types keep their small biases. Q4_0 and Q8_0 rewrite every byte of `raw` (a byte
    table, a mask), the f16 scale bytes too: the caller sets those after.
    """
    if qtype == Q.Q4_0:  # 16 bytes of nibbles after the f16 scale: q = 0 -> 8 (value 0)
        np.copyto(raw, _Q4_0_CENTER[raw])
    elif qtype == Q.Q8_0:  # 32 int8 codes after the f16 scale: -128 (byte 0x80) -> 0
        np.putmask(raw, raw == 0x80, 0)
    elif qtype in (Q.Q4_K, Q.Q5_K):  # 12 bytes at offset 4: 8 six-bit scales and 8 mins
        # ggml's get_scale_min_k4: sub-block j < 4 has scale b[j] & 63, min b[j+4] & 63;
        # j >= 4 has scale b[j+4] & 15 | (b[j-4] >> 6) << 4, min b[j+4] >> 4 | (b[j] >> 6) << 4
        # so min = scale: bytes 4..7 = bytes 0..3, and bytes 8..11 = their low nibble twice.
        # Done on 32-bit words 1, 2, 3 of each block (144 and 176 bytes are multiples of 4).
        words = raw.view(np.uint32)  # [n_blocks, type_bytes / 4]
        words[:, 2] = words[:, 1]
        low = words[:, 3] & np.uint32(0x0F0F0F0F)
        words[:, 3] = low | (low << np.uint32(4))


@cache
def _unit_std(qtype: Q, centered: bool = False) -> float:
    """Standard deviation of decoded values when the base scale d is 1."""
    block = GGML_QUANT_SIZES[qtype][0]
    raw = _blocks(np.random.default_rng(1234), qtype, _PROBE_ROWS, 4 * block, 1.0, centered)
    return float(gq.dequantize(raw, qtype).std())


def random_tensor(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...], std: float,
                  centered: bool = False) -> np.ndarray:
    """A tensor of logical `shape` (numpy order) stored as `qtype`, values with std ~ `std`
    (`centered`: symmetric around zero, see `_center`).

    Returns float arrays for F32/F16, uint8 `[..., row_bytes]` for BF16 and quantized types.
    """
    if qtype in FLOAT_TYPES:
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if qtype == Q.F32:
            return x
        if qtype == Q.F16:
            return x.astype(np.float16)
        return gq.quantize(x, Q.BF16)
    if qtype not in SCALE_FIELDS:
        raise ValueError(f"synthetic weights do not support quant type {qtype.name}")
    n_cols = shape[-1]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    raw = _blocks(rng, qtype, n_rows, n_cols, std / _unit_std(qtype, centered), centered)
    return raw.reshape(*shape[:-1], raw.shape[-1])
