"""Dequantize and fused dequantize-GEMV on CUDA: CuPy `RawModule`s compiled by NVRTC.

The CUDA C is in `quant_blocks.cu` (one block decoder per quant type) and `quant_kernels.cu`
(the kernels); both are read at first use. CuPy passes NVRTC `-arch=sm_XX` for the current
device, so kernels are built as SASS for the GPU they run on (sm_90 on H100/H200), not as PTX;
the binaries are cached on disk by CuPy (`~/.cupy/kernel_cache`).

Device bytes are a cupy uint8 array holding GGUF rows exactly as the file stores them (an
expert-cache slot, a staging-ring slot, a region view). Block sizes come from
`gguf.GGML_QUANT_SIZES`; `check_layouts()` asserts that the .cu declares the same ones.
Lookup tables (the IQ4_NL values, the IQ3_XXS grid) come from `gguf.quants` and are copied to
the device once per process (a constant table, not model data, so not a counted upload).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

_DIR = Path(__file__).parent
_THREADS = 128  # 4 warps; must match WARPS in quant_kernels.cu
_MAX_BATCH = 8

# quant type -> decoder struct in quant_blocks.cu
DECODERS: dict[Q, str] = {
    Q.F32: "BF32",
    Q.F16: "BF16h",
    Q.BF16: "BBF16",
    Q.Q8_0: "BQ8_0",
    Q.Q4_0: "BQ4_0",
    Q.Q4_1: "BQ4_1",
    Q.Q5_0: "BQ5_0",
    Q.Q5_1: "BQ5_1",
    Q.Q4_K: "BQ4_K",
    Q.Q5_K: "BQ5_K",
    Q.Q6_K: "BQ6_K",
    Q.IQ3_XXS: "BIQ3_XXS",
    Q.IQ4_XS: "BIQ4_XS",
}
SUPPORTED = tuple(DECODERS)
_FLOAT_PSEUDO_BLOCK = 8  # float types are decoded 8 values at a time


def kernel_source() -> str:
    """The CUDA C of the decoders and kernels, as compiled."""
    return (_DIR / "quant_blocks.cu").read_text() + "\n" + (_DIR / "quant_kernels.cu").read_text()


def block_layout(qtype: Q) -> tuple[int, int]:
    """(values, bytes) of one block as the decoders see it; float types use 8-value blocks."""
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    if block == 1:
        return _FLOAT_PSEUDO_BLOCK, _FLOAT_PSEUDO_BLOCK * type_bytes
    return block, type_bytes


def check_layouts(source: str | None = None) -> None:
    """Assert that every decoder's `enum { QK, TS }` equals gguf's block layout."""
    text = kernel_source() if source is None else source
    for qtype, struct in DECODERS.items():
        m = re.search(rf"struct {struct} \{{[^}}]*?enum \{{ QK = (\d+), TS = (\d+) \}}", text)
        assert m, f"decoder {struct} for {qtype.name} not found in the kernel source"
        declared = (int(m.group(1)), int(m.group(2)))
        assert declared == block_layout(qtype), (
            f"{struct}: .cu declares (QK, TS) = {declared}, gguf says {block_layout(qtype)}"
        )


def lookup_table(qtype: Q) -> np.ndarray:
    """uint32 [n] lookup table a decoder reads (empty for types without one)."""
    if qtype == Q.IQ4_XS:  # 16 int8 non-linear values, packed 4 per word
        return np.array(gq.IQ4_NL.kvalues, dtype=np.int8).view(np.uint32)
    if qtype == Q.IQ3_XXS:  # 256 grid points of 4 byte-sized values each
        gq.IQ3_XXS.init_grid()
        grid = np.asarray(gq.IQ3_XXS.grid).reshape(256, 4).astype(np.uint8)
        return np.ascontiguousarray(grid).view(np.uint32).reshape(256)
    return np.zeros(0, dtype=np.uint32)


def _cupy() -> Any:
    import cupy

    return cupy


@functools.cache
def _function(name_expression: str) -> Any:
    """One compiled kernel instantiation (compiled on first use, cached by CuPy on disk)."""
    cp = _cupy()
    source = kernel_source()
    check_layouts(source)
    module = cp.RawModule(code=source, options=("-std=c++17",), name_expressions=(name_expression,))
    return module.get_function(name_expression)


@functools.cache
def _device_table(qtype: Q, device_id: int) -> tuple[Any, int]:
    cp = _cupy()
    host = lookup_table(qtype)
    with cp.cuda.Device(device_id):
        table = cp.asarray(host if host.size else np.zeros(1, dtype=np.uint32))
    return table, int(host.size)


def _check_qtype(qtype: Q) -> None:
    if qtype not in DECODERS:
        supported = ", ".join(q.name for q in SUPPORTED)
        raise NotImplementedError(f"no CUDA decoder for {qtype.name}; supported: {supported}")


def _n_bytes(qtype: Q, shape: Sequence[int]) -> int:
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    assert shape[-1] % block == 0, f"{tuple(shape)}: last dim not a multiple of {block}"
    return n // block * type_bytes


def _decoder_align(qtype: Q) -> int:
    ts = block_layout(qtype)[1]
    return 4 if ts % 4 == 0 else 2


def dequantize_many(
    srcs: Sequence[Any], qtype: Q, shape: Sequence[int], outs: Sequence[Any]
) -> None:
    """Decode several tensors of one qtype and shape in one launch: srcs[i] -> outs[i].

    srcs: cupy uint8 arrays (or anything with `.data.ptr`) of the tensor's bytes;
    outs: contiguous cupy float16 or float32 arrays of `prod(shape)` values, one dtype for all.
    """
    cp = _cupy()
    _check_qtype(qtype)
    assert len(srcs) == len(outs) and len(srcs) > 0, (len(srcs), len(outs))
    n_values = int(np.prod(shape))
    align = _decoder_align(qtype)
    for s in srcs:
        assert s.nbytes >= _n_bytes(qtype, shape), (s.nbytes, _n_bytes(qtype, shape))
        assert s.data.ptr % align == 0, f"{qtype.name} bytes at {s.data.ptr:#x}: need {align}-alignment"
    f16 = outs[0].dtype == cp.float16
    for o in outs:
        assert o.dtype == outs[0].dtype and o.dtype in (cp.float16, cp.float32), o.dtype
        assert o.size == n_values and o.flags.c_contiguous and o.data.ptr % 16 == 0
    kernel = _function(f"dequant_multi<{DECODERS[qtype]}, {'true' if f16 else 'false'}>")
    table, n_tab = _device_table(qtype, outs[0].device.id)
    ptrs = np.array(
        [s.data.ptr for s in srcs] + [o.data.ptr for o in outs], dtype=np.uint64
    )  # [2 * n_jobs]
    dptrs = cp.asarray(ptrs)
    n_jobs = len(srcs)
    n_groups = n_values // 8
    blocks = min((n_groups + 255) // 256, 65535)
    kernel(
        (blocks, n_jobs),
        (256,),
        (dptrs[:n_jobs], dptrs[n_jobs:], np.int64(n_groups), table, np.int32(n_tab)),
    )


def dequantize(dev_bytes: Any, qtype: Q, shape: Sequence[int], out_dtype: Any = np.float16) -> Any:
    """uint8 device bytes of a GGUF tensor -> cupy array of `shape` (float16 or float32)."""
    cp = _cupy()
    out = cp.empty(tuple(shape), dtype=out_dtype)
    dequantize_many([dev_bytes], qtype, shape, [out])
    return out


def _rows_per_warp(n_out: int) -> int:
    """More rows per warp share x loads; fewer keep small matrices spread over every SM."""
    if n_out >= 8192:
        return 4
    if n_out >= 2048:
        return 2
    return 1


def gemv(dev_bytes: Any, qtype: Q, shape: Sequence[int], x: Any, out: Any = None) -> Any:
    """y = W @ x with W the quantized matrix [n_out, n_in] in `dev_bytes`.

    x: [n_in] or [B, n_in] with B <= 8 (any float dtype; computed in float32).
    Returns float32 [n_out] or [B, n_out] (written into `out` when given).
    """
    cp = _cupy()
    _check_qtype(qtype)
    n_out, n_in = (int(s) for s in shape)
    vector = x.ndim == 1
    xb = cp.ascontiguousarray(x.reshape(1, -1) if vector else x, dtype=cp.float32)  # [B, n_in]
    n_batch = xb.shape[0]
    assert xb.shape[1] == n_in, f"x has {xb.shape[1]} values, the matrix {n_in} columns"
    assert 1 <= n_batch <= _MAX_BATCH, f"gemv takes at most {_MAX_BATCH} vectors, got {n_batch}"
    y = cp.empty((n_batch, n_out), dtype=cp.float32) if out is None else out  # [B, n_out]
    assert y.dtype == cp.float32 and y.size == n_batch * n_out and y.flags.c_contiguous
    row_bytes = _n_bytes(qtype, (1, n_in))
    ptr = dev_bytes.data.ptr
    if ptr % 16 == 0 and row_bytes % 16 == 0:  # staged with 16-byte loads
        word, rows = "uint4", _rows_per_warp(n_out)
    elif ptr % 4 == 0 and row_bytes % 4 == 0:
        word, rows = "u32", 1
    else:  # rows only 2-byte aligned (every block size is even)
        if ptr % 2:
            dev_bytes = cp.array(dev_bytes[: n_out * row_bytes], copy=True)
        word, rows = "u16", 1
    kernel = _function(f"gemv<{DECODERS[qtype]}, {rows}, {n_batch}, {word}>")
    table, n_tab = _device_table(qtype, xb.device.id)
    warps = (n_out + rows - 1) // rows
    grid = (warps + _THREADS // 32 - 1) // (_THREADS // 32)
    kernel(
        (grid,),
        (_THREADS,),
        (dev_bytes, xb, y, np.int32(n_out), np.int32(n_in), table, np.int32(n_tab)),
    )
    return y.reshape(n_out) if vector else y.reshape(n_batch, n_out)
