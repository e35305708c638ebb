"""Dequantize and fused dequantize-GEMV on CUDA: CuPy `RawModule`s compiled by NVRTC.

The CUDA C is in `quant_blocks.cu` (one block decoder per quant type) and `quant_kernels.cu`
(the kernels); both are read at first use. CuPy passes NVRTC `-arch=sm_XX` for the current
device, so kernels are built as SASS for the GPU they run on (sm_90 on H100/H200), not as PTX;
the binaries are cached on disk by CuPy (`~/.cupy/kernel_cache`).

Device bytes are a cupy uint8 array holding GGUF rows exactly as the file stores them (an
expert-cache slot, a staging-ring slot, a region view). Block sizes come from
`gguf.GGML_QUANT_SIZES`; `check_layouts()` asserts that the .cu declares the same ones.
Lookup tables (the IQ4_NL and MXFP4 values, the IQ2/IQ3/IQ1 grids) come from `gguf.quants` and
are copied to the device once per process (a constant table, not model data, so not a counted
upload); the kernels stage a decoder's table in shared memory, NTAB words as the .cu declares.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.config import DECODE_ROWS
from engine.kernels.lifetime import process_lifetime

_DIR = Path(__file__).parent
_THREADS = 128  # 4 warps; must match WARPS in quant_kernels.cu
# Vectors one gemv launch takes at most: the kernel is instantiated for each batch up to a
# decode step's rows, so each linear of a step (and of a prompt chunk that short) is one launch
# (the token graph captures only such steps).
GEMV_MAX_ROWS = DECODE_ROWS
DECODE_SLICE_BYTES = 64 << 20  # a quantized weight decoded for a GEMM: fp16 bytes at a time

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
    Q.Q2_K: "BQ2_K",
    Q.Q3_K: "BQ3_K",
    Q.IQ2_XXS: "BIQ2_XXS",
    Q.IQ2_XS: "BIQ2_XS",
    Q.IQ2_S: "BIQ2_S",
    Q.IQ3_S: "BIQ3_S",
    Q.IQ1_S: "BIQ1_S",
    Q.IQ1_M: "BIQ1_M",
    Q.IQ4_NL: "BIQ4_NL",
    Q.MXFP4: "BMXFP4",
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


_ENUM = r"enum \{ QK = (\d+), TS = (\d+)(?:, NTAB = (\d+))? \}"
MAX_TABLE_WORDS = 2048  # 8 KiB of shared memory per block for a decoder's table


def declared_layouts(source: str | None = None) -> dict[Q, tuple[int, int, int]]:
    """(QK, TS, NTAB) of every decoder as the .cu declares them (NTAB 0 where absent)."""
    text = kernel_source() if source is None else source
    out = {}
    for qtype, struct in DECODERS.items():
        m = re.search(rf"struct {struct} \{{[^}}]*?" + _ENUM, text)
        assert m, f"decoder {struct} for {qtype.name} not found in the kernel source"
        out[qtype] = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    return out


def check_layouts(source: str | None = None) -> None:
    """Assert that every decoder's `enum { QK, TS }` equals gguf's block layout and that its
    lookup table fits the NTAB words it declares."""
    for qtype, (qk, ts, ntab) in declared_layouts(source).items():
        struct = DECODERS[qtype]
        assert (qk, ts) == block_layout(qtype), (
            f"{struct}: .cu declares (QK, TS) = {(qk, ts)}, gguf says {block_layout(qtype)}"
        )
        n = lookup_table(qtype).size
        assert n <= ntab <= MAX_TABLE_WORDS and (ntab == 0) == (n == 0), (
            f"{struct}: a table of {n} words, NTAB = {ntab} (at most {MAX_TABLE_WORDS})"
        )


# grid types whose points are byte-sized values, one byte each (4 or 8 a point)
_BYTE_GRIDS = {
    Q.IQ3_XXS: gq.IQ3_XXS,
    Q.IQ3_S: gq.IQ3_S,
    Q.IQ2_XXS: gq.IQ2_XXS,
    Q.IQ2_XS: gq.IQ2_XS,
    Q.IQ2_S: gq.IQ2_S,
}


def _build_table(qtype: Q) -> np.ndarray:
    if qtype in (Q.IQ4_XS, Q.IQ4_NL):  # 16 int8 non-linear values, packed 4 per word
        return np.array(gq.IQ4_NL.kvalues, dtype=np.int8).view(np.uint32)
    if qtype == Q.MXFP4:  # the 16 E2M1 values doubled, as int8, packed 4 per word
        return np.array(gq.MXFP4.kvalues, dtype=np.int8).view(np.uint32)
    if qtype in _BYTE_GRIDS:  # grid points of 4 or 8 byte-sized values: 1 or 2 words a point
        cls = _BYTE_GRIDS[qtype]
        cls.init_grid()
        grid = np.asarray(cls.grid).reshape(cls.grid_shape)
        assert grid.min() >= 0 and grid.max() <= 255 and np.all(grid == np.round(grid))
        return np.ascontiguousarray(grid.astype(np.uint8)).view(np.uint32).reshape(-1)
    if qtype in (Q.IQ1_S, Q.IQ1_M):  # 2048 points of 8 values in {-1, 0, 1}: 2-bit codes
        cls = gq.IQ1_S if qtype == Q.IQ1_S else gq.IQ1_M
        # the decoder reads a value as code - 1 and adds a delta of +-1/8
        assert tuple(cls.grid_map) == (-1, 0, 1) and float(cls.delta) == 0.125
        cls.init_grid()
        codes = (np.asarray(cls.grid).reshape(cls.grid_shape) + 1).astype(np.uint32)  # [2048, 8]
        point = (codes << (2 * np.arange(8, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
        return point[0::2] | (point[1::2] << np.uint32(16))  # [1024]: points 2w, 2w + 1
    return np.zeros(0, dtype=np.uint32)


@functools.cache
def lookup_table(qtype: Q) -> np.ndarray:
    """uint32 [n] lookup table a decoder reads (empty for types without one); read-only."""
    table = _build_table(qtype)
    table.flags.writeable = False
    return table


def _cupy() -> Any:
    import cupy

    return cupy


GEMV_ROWS = (1, 2, 4)  # rows per warp the GEMV is instantiated for (`_rows_per_warp`)
# A decoder's instantiations in modules of their own, so that a machine's first run compiles
# them on parallel threads: the dequantize kernels, then the GEMV per rows per warp
PARTS = ("dequant", *(f"gemv{rows}" for rows in GEMV_ROWS))


def _names(decoder: str, part: str) -> tuple[str, ...]:
    """The instantiations of one part of a decoder: dequantize to fp16 / fp32 ("dequant"), or
    the fused GEMV of `rows` rows per warp for each batch, 1..GEMV_MAX_ROWS vectors ("gemvN")."""
    if part == "dequant":
        return tuple(f"dequant_multi<{decoder}, {f16}>" for f16 in ("true", "false"))
    assert part in PARTS, part
    rows = int(part.removeprefix("gemv"))
    return tuple(f"gemv<{decoder}, {rows}, {b}>" for b in range(1, GEMV_MAX_ROWS + 1))


@functools.cache
def _module(decoder: str, part: str) -> Any:
    """A part of a decoder's instantiations in one NVRTC compile (cached by CuPy on disk): a
    decode step that meets a new batch size (a verify window, experts shared by its rows)
    finds its kernel loaded, instead of stalling for a compile of its own."""
    cp = _cupy()
    source = kernel_source()
    check_layouts(source)
    return cp.RawModule(code=source, options=("-std=c++17",),
                        name_expressions=_names(decoder, part))


def _function(decoder: str, part: str, name_expression: str) -> Any:
    return _module(decoder, part).get_function(name_expression)


def preload(qtypes: Sequence[Q]) -> None:
    """Compile and load the kernels of these quant types now (a model's tensor types),
    before the CUDA backend measures what the process holds and before any request."""
    for job in preload_jobs(qtypes):
        job()


def preload_jobs(qtypes: Sequence[Q]) -> list[Callable[[], None]]:
    """One job per part of each decoder these quant types need (types without one are left
    out): each compiles its module (NVRTC, or CuPy's disk cache) and loads it. A `RawModule`
    compiles at its first `get_function`, so each job asks for one of its kernels. The jobs
    may run on threads of their own (engine/kernels/warmup.py)."""
    decoders = dict.fromkeys(DECODERS[q] for q in qtypes if q in DECODERS)
    return [functools.partial(_compile, d, part) for d in decoders for part in PARTS]


def _compile(decoder: str, part: str) -> None:
    _module(decoder, part).get_function(_names(decoder, part)[0])


@functools.cache
def _device_table(qtype: Q, device_id: int) -> tuple[Any, int]:
    cp = _cupy()
    host = lookup_table(qtype)
    # cached for the process: never from a prompt chunk's arena, whose memory is lent
    with cp.cuda.Device(device_id), process_lifetime():
        table = cp.asarray(host if host.size else np.zeros(1, dtype=np.uint32))
    return table, int(host.size)


def _check_qtype(qtype: Q) -> None:
    # the loader refuses every type without a decoder (tests/test_mixes.py ties the two lists)
    assert qtype in DECODERS, f"no CUDA decoder for {qtype.name}; supported: {SUPPORTED}"


def _n_bytes(qtype: Q, shape: Sequence[int]) -> int:
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    assert shape[-1] % block == 0, f"{tuple(shape)}: last dim not a multiple of {block}"
    return n // block * type_bytes


def _decoder_align(qtype: Q) -> int:
    """The largest of 4, 2, 1 dividing the block bytes: decoders load at most 4-byte words."""
    ts = block_layout(qtype)[1]
    return 4 if ts % 4 == 0 else 2 if ts % 2 == 0 else 1


def dequantize_many(
    srcs: Sequence[Any], qtype: Q, shape: Sequence[int], outs: Sequence[Any]
) -> None:
    """Decode several tensors of one qtype and shape in one launch: srcs[i] -> outs[i].

    srcs: cupy uint8 arrays of the tensors' bytes; outs: contiguous cupy float16 or float32
    arrays of `prod(shape)` values, one dtype for all.
    """
    cp = _cupy()
    assert len(srcs) == len(outs) and len(srcs) > 0, (len(srcs), len(outs))
    n_values = int(np.prod(shape))
    for s in srcs:
        assert s.nbytes >= _n_bytes(qtype, shape), (s.nbytes, _n_bytes(qtype, shape))
    for o in outs:
        assert o.dtype == outs[0].dtype and o.dtype in (cp.float16, cp.float32), o.dtype
        assert o.size == n_values and o.flags.c_contiguous, (o.size, n_values)
    dequantize_ptrs(
        [s.data.ptr for s in srcs], [o.data.ptr for o in outs], qtype, n_values,
        f16=outs[0].dtype == cp.float16, device_id=outs[0].device.id,
    )  # fmt: skip


def dequantize_ptrs(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    qtype: Q,
    n_values: int,
    *,
    f16: bool,
    device_id: int,
) -> None:
    """`dequantize_many` on raw device addresses, for hot loops that cannot afford a cupy view
    per tensor; the caller vouches for the sizes. Sources need the decoder's alignment
    (1, 2 or 4 bytes), destinations 16."""
    cp = _cupy()
    _check_qtype(qtype)
    align = _decoder_align(qtype)
    assert all(p % align == 0 for p in src_ptrs), f"{qtype.name} sources need {align}-alignment"
    assert all(p % 16 == 0 for p in dst_ptrs), "dequantize outputs need 16-byte alignment"
    decoder = DECODERS[qtype]
    kernel = _function(decoder, "dequant", f"dequant_multi<{decoder}, {'true' if f16 else 'false'}>")
    table, n_tab = _device_table(qtype, device_id)
    n_jobs = len(src_ptrs)
    ptrs = cp.asarray(np.array([*src_ptrs, *dst_ptrs], dtype=np.uint64))  # [2 * n_jobs]
    n_groups = n_values // 8
    blocks = min(-(-n_groups // (256 * _groups_per_thread(n_tab, n_groups * n_jobs))), 65535)
    dsts = np.uint64(ptrs.data.ptr + 8 * n_jobs)
    kernel((blocks, n_jobs), (256,), (ptrs, dsts, np.int64(n_groups), table, np.int32(n_tab)))


def _groups_per_thread(n_tab: int, total_groups: int) -> int:
    """Groups of 8 each dequantize thread decodes: a block fills its shared table once, so a
    table of more than 256 words (IQ2/IQ3_S/IQ1 grids) is spread over as many groups as it has
    words per thread, while the launch keeps >= 1024 blocks. 1 for the other types."""
    return max(1, min(n_tab // 256, total_groups // (256 * 1024)))


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


def _gemv_kernel(
    qtype: Q, ptrs: Sequence[int], n_out: int, n_in: int, n_batch: int, rows: int = 0
) -> Any:
    """The gemv instantiation and grid for these weight addresses (decoder-aligned)."""
    _check_qtype(qtype)
    assert 1 <= n_batch <= GEMV_MAX_ROWS, f"gemv takes at most {GEMV_MAX_ROWS} vectors, got {n_batch}"
    align = _decoder_align(qtype)
    assert all(p % align == 0 for p in ptrs), f"{qtype.name} weights need {align}-alignment"
    rows = rows or _rows_per_warp(n_out)
    assert rows in GEMV_ROWS, rows
    warps = (n_out + rows - 1) // rows
    grid = (warps + _THREADS // 32 - 1) // (_THREADS // 32)
    decoder = DECODERS[qtype]
    return _function(decoder, f"gemv{rows}", f"gemv<{decoder}, {rows}, {n_batch}>"), grid


def gemv(
    dev_bytes: Any,
    qtype: Q,
    shape: Sequence[int],
    x: Any,
    out: Any = None,
    *,
    rows_per_warp: int = 0,
) -> Any:
    """y = W @ x with W the quantized matrix [n_out, n_in] in `dev_bytes`.

    x: [n_in] or [B, n_in] with B <= GEMV_MAX_ROWS (any float dtype; computed in float32).
    Returns float32 [n_out] or [B, n_out] (written into `out` when given). `rows_per_warp`
    (1, 2 or 4) overrides the choice by matrix height (benchmarks).
    """
    cp = _cupy()
    n_out, n_in = (int(s) for s in shape)
    vector = x.ndim == 1
    xb = cp.ascontiguousarray(x.reshape(1, -1) if vector else x, dtype=cp.float32)  # [B, n_in]
    n_batch = xb.shape[0]
    assert xb.shape[1] == n_in, f"x has {xb.shape[1]} values, the matrix {n_in} columns"
    assert dev_bytes.nbytes >= _n_bytes(qtype, shape), (dev_bytes.nbytes, tuple(shape))
    y = cp.empty((n_batch, n_out), dtype=cp.float32) if out is None else out  # [B, n_out]
    assert y.dtype == cp.float32 and y.size == n_batch * n_out and y.flags.c_contiguous
    if dev_bytes.data.ptr % _decoder_align(qtype):  # rare: decode from an aligned copy
        dev_bytes = cp.array(dev_bytes[: _n_bytes(qtype, shape)], copy=True)
    kernel, grid = _gemv_kernel(qtype, [dev_bytes.data.ptr], n_out, n_in, n_batch, rows_per_warp)
    table, n_tab = _device_table(qtype, xb.device.id)
    args = (dev_bytes, xb, y, np.int32(n_out), np.int32(n_in), table, np.int32(n_tab), np.uint64(0))
    kernel((grid,), (_THREADS,), args)
    return y.reshape(n_out) if vector else y.reshape(n_batch, n_out)


def gemv_many(ws: Sequence[Any], qtype: Q, shape: Sequence[int], x: Any, out: Any = None) -> Any:
    """y[j] = W_j @ x[j] for J matrices of one qtype and shape, in one launch.

    ws: J uint8 device arrays (e.g. expert-cache slot views); x: float32 [J, n_in] or
    [J, B, n_in], each x[j] contiguous, any stride between jobs (0: one x shared by all, as
    `cupy.broadcast_to` makes). Returns float32 [J, n_out] or [J, B, n_out].
    """
    cp = _cupy()
    n_out, n_in = (int(s) for s in shape)
    n_jobs = len(ws)
    xj = x.reshape(x.shape[0], 1, x.shape[1]) if x.ndim == 2 else x  # [J, B, n_in]
    assert xj.shape[0] == n_jobs and xj.shape[2] == n_in, (xj.shape, n_jobs, n_in)
    n_batch = xj.shape[1]
    if xj.dtype != cp.float32 or xj.strides[2] != 4 or (n_batch > 1 and xj.strides[1] != 4 * n_in):
        xj = cp.ascontiguousarray(xj, dtype=cp.float32)
    y = cp.empty((n_jobs, n_batch, n_out), dtype=cp.float32) if out is None else out
    assert y.dtype == cp.float32 and y.size == n_jobs * n_batch * n_out and y.flags.c_contiguous
    for w in ws:
        assert w.nbytes >= _n_bytes(qtype, shape), (w.nbytes, tuple(shape))
    jobs = np.empty((n_jobs, 3), dtype=np.uint64)  # [J, (w, x, y)] launch metadata
    jobs[:, 0] = [w.data.ptr for w in ws]
    jobs[:, 1] = xj.data.ptr + np.arange(n_jobs, dtype=np.uint64) * np.uint64(xj.strides[0])
    jobs[:, 2] = y.data.ptr + np.arange(n_jobs, dtype=np.uint64) * np.uint64(n_batch * n_out * 4)
    gemv_ptrs(jobs, qtype, shape, n_batch, device_id=y.device.id)
    return y.reshape(n_jobs, n_out) if x.ndim == 2 else y


def gemv_ptrs(
    jobs: np.ndarray, qtype: Q, shape: Sequence[int], n_batch: int, *, device_id: int
) -> None:
    """`gemv_many` on raw device addresses: jobs uint64 [J, 3] rows of (weights, x [B, n_in]
    float32, y [B, n_out] float32) addresses; the caller vouches for the sizes."""
    cp = _cupy()
    n_out, n_in = (int(s) for s in shape)
    kernel, grid = _gemv_kernel(qtype, jobs[:, 0].tolist(), n_out, n_in, n_batch)
    table, n_tab = _device_table(qtype, device_id)
    dev_jobs = cp.asarray(np.ascontiguousarray(jobs, dtype=np.uint64))  # [J, 3]
    null = np.uint64(0)  # w, x, y come from the job table
    args = (null, null, null, np.int32(n_out), np.int32(n_in), table, np.int32(n_tab), dev_jobs)
    kernel((grid, len(jobs)), (_THREADS,), args)


def gemv_jobs(dev_jobs: Any, qtype: Q, shape: Sequence[int], n_batch: int = 1) -> None:
    """`gemv_ptrs` with the job rows already on the device (uint64 [J, 3]: weights, x, y), as
    the token graph builds them from routed ids: no host copy, so the launch can be captured.
    The job builder vouches for the sizes and the decoder alignment of the weight addresses."""
    n_out, n_in = (int(s) for s in shape)
    kernel, grid = _gemv_kernel(qtype, [], n_out, n_in, n_batch)
    table, n_tab = _device_table(qtype, dev_jobs.device.id)
    null = np.uint64(0)
    args = (null, null, null, np.int32(n_out), np.int32(n_in), table, np.int32(n_tab), dev_jobs)
    kernel((grid, dev_jobs.shape[0]), (_THREADS,), args)


def decoder_align(qtype: Q) -> int:
    """Byte alignment the GEMV's block decoder needs for a weight address."""
    return _decoder_align(qtype)
