"""Random but valid quantized blocks for synthetic models.

`gguf.quants` can quantize only some types, and quantizing tens of GB of random floats would
take minutes; instead we draw the block bytes directly (every byte pattern of these formats
decodes to finite values once the f16 scale fields are set) and set the scale fields so the
decoded weights have the requested standard deviation. Decoding stays `gguf.quants`' job.
"""

from __future__ import annotations

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
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
_PROBE_ROWS = 64


def _blocks(rng: np.random.Generator, qtype: Q, n_rows: int, n_cols: int, d: float) -> np.ndarray:
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * (n_cols // block)
    raw = rng.integers(0, 256, size=(n_blocks, type_bytes), dtype=np.uint8)
    for offset, mult in SCALE_FIELDS[qtype]:
        raw[:, offset : offset + 2] = np.array([d * mult], dtype=np.float16).view(np.uint8)
    return raw.reshape(n_rows, -1)  # [rows, row_bytes]


@cache
def _unit_std(qtype: Q) -> float:
    """Standard deviation of decoded values when the base scale d is 1."""
    block = GGML_QUANT_SIZES[qtype][0]
    raw = _blocks(np.random.default_rng(1234), qtype, _PROBE_ROWS, 4 * block, 1.0)
    return float(gq.dequantize(raw, qtype).std())


def random_tensor(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...], std: float) -> np.ndarray:
    """A tensor of logical `shape` (numpy order) stored as `qtype`, values with std ~ `std`.

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
    raw = _blocks(rng, qtype, n_rows, n_cols, std / _unit_std(qtype))
    return raw.reshape(*shape[:-1], raw.shape[-1])
