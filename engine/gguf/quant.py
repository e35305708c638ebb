"""Dequantization on the CPU through `gguf.quants`; block sizes from `gguf.GGML_QUANT_SIZES`;
`ExpertLayout`, the byte layout of one expert blob (the record the MoE kernels take);
`QuantMatrix`, a dense weight kept in its file's blocks on the device.

Our own decoders exist only where the library cannot serve (the CUDA kernels), and are tested
against these. Large tensors (the output head, a model's dense weights) are decoded in row
chunks on a thread pool: numpy releases the GIL, and the chunks also fit the caches better
(the 151,936 x 2,048 Q8_0 head: 4.9 s in one call, 1.9 s in chunks on 2 cores).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from engine.gguf.reader import TensorView

F32 = GGMLQuantizationType.F32


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements stored as `qtype`."""
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    assert n_cols % block == 0, f"{n_cols} columns is not a multiple of {qtype.name} block {block}"
    return n_cols // block * type_bytes


def dequantize_bytes(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode raw bytes (uint8, any leading layout) into a float32 array of `shape`."""
    if qtype == F32:
        return np.ascontiguousarray(raw).view(np.float32).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return np.ascontiguousarray(raw).view(np.float16).reshape(shape).astype(np.float32)
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, row_bytes(qtype, shape[-1]))
    step = max(1, CHUNK_BYTES // flat.shape[1])  # rows per chunk
    if flat.shape[0] <= step:
        return gq.dequantize(flat, qtype).reshape(shape).astype(np.float32, copy=False)
    out = np.empty((flat.shape[0], shape[-1]), dtype=np.float32)  # [rows, n_cols]

    def chunk(i: int) -> None:
        out[i : i + step] = gq.dequantize(flat[i : i + step], qtype)

    chunk(0)  # first on this thread: the library builds its lookup tables once
    list(_pool().map(chunk, range(step, flat.shape[0], step)))
    return out.reshape(shape)


CHUNK_BYTES = 4 << 20  # raw bytes per chunk of rows


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="dequant")


def dequantize(t: TensorView) -> np.ndarray:
    """Decode a whole GGUF tensor into float32 with its numpy-order shape."""
    return dequantize_bytes(t.raw, t.qtype, t.shape)


# block-quantized types a dense weight is kept in on the device (`keeps_quantized`): every one
# the CUDA kernels decode; float types are decoded to the device's float type instead
KEPT_QUANTIZED = frozenset(GGMLQuantizationType[name] for name in (
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S",
    "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4",
))


def keeps_quantized(qtype: GGMLQuantizationType) -> bool:
    """Whether a dense weight stored as `qtype` stays in its blocks on a device that computes
    from quantized bytes (`--dense quant`)."""
    return qtype in KEPT_QUANTIZED


def matrix_bytes(qtype: GGMLQuantizationType, shape: tuple[int, int], float_bytes: int,
                 quantized: bool) -> int:
    """Device bytes of a dense weight [n_out, n_in] stored as `qtype` in the file: its blocks
    when `quantized` and the type is kept so, else `float_bytes` per element."""
    if quantized and keeps_quantized(qtype):
        return shape[0] * row_bytes(qtype, shape[1])
    return float_bytes * shape[0] * shape[1]


@dataclass(frozen=True)
class QuantMatrix:
    """A dense weight [n_out, n_in] kept in its file's quantized blocks on the device.

    `raw`: uint8 [n_out * row_bytes] device bytes, rows in the file's order. The backend's
    `linear` reads it: the fused dequantize-GEMV for a few rows, else a decode to fp16 and a
    GEMM. Rows are independent, so `rows(a, b)` is a view of rows a..b-1.
    """

    raw: Any
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.qtype, self.shape[1])

    def rows(self, start: int, stop: int) -> QuantMatrix:
        """Rows start..stop-1 (a view of the same bytes)."""
        rb = self.row_bytes
        return QuantMatrix(self.raw[start * rb : stop * rb], self.qtype, (stop - start, self.shape[1]))

    def decode(self) -> np.ndarray:
        """float32 [n_out, n_in] on the host (the array backends compute from this)."""
        return dequantize_bytes(np.asarray(self.raw), self.qtype, self.shape)


@dataclass(frozen=True)
class QuantStack:
    """A dense weight [sum of rows, n_in] stacked by rows from `QuantMatrix` parts of different
    quant types (q, k and v of a layer where a quant mix gives attn_v more bits: Q4_K_M's Q6_K
    on half the layers): each part stays in its blocks, and `linear` is one product per part."""

    parts: tuple[QuantMatrix, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def rows(self, start: int, stop: int) -> QuantMatrix | QuantStack:
        """Rows start..stop-1: a view of one part's rows where they lie in one part."""
        out, base = [], 0
        for p in self.parts:
            a, b = max(start, base), min(stop, base + p.shape[0])
            if a < b:
                out.append(p.rows(a - base, b - base))
            base += p.shape[0]
        return out[0] if len(out) == 1 else QuantStack(tuple(out))

    def decode(self) -> np.ndarray:
        """float32 [n_out, n_in] on the host."""
        return np.concatenate([p.decode() for p in self.parts])


def matrix_rows(w: Any, start: int, stop: int) -> Any:
    """Rows start..stop-1 of a dense weight, an array [n_out, n_in], a `QuantMatrix` or a
    `QuantStack` (a view)."""
    return w.rows(start, stop) if isinstance(w, QuantMatrix | QuantStack) else w[start:stop]


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert blob: three matrices, each with its own quant type."""

    qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType]
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # gate [f,d], up [f,d], down [d,f]

    @property
    def part_bytes(self) -> tuple[int, int, int]:
        return tuple(s[0] * row_bytes(q, s[1]) for q, s in zip(self.qtypes, self.shapes))  # type: ignore[return-value]

    @property
    def blob_bytes(self) -> int:
        return sum(self.part_bytes)

    def decode(self, blob: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """uint8 [blob_bytes] -> float32 (gate [f, d], up [f, d], down [d, f])."""
        out = []
        off = 0
        for q, shape, n in zip(self.qtypes, self.shapes, self.part_bytes):
            out.append(dequantize_bytes(blob[off : off + n], q, shape))
            off += n
        return out[0], out[1], out[2]
