"""Causal grouped-query attention for the CUDA prompt path: fp16 tensor-core GEMMs, fused softmax.

`causal_attention(q [T, H, D], k, v [S, Hkv, D], pos0)` -> float32 [T, H, D], the same result as
`engine.backend.array_ops.causal_gqa` (query i sits at position pos0 + i and sees keys
0..pos0 + i), for long prompt chunks (up to 16,384 queries over up to ~72,000 keys).

Per call:

1. q, k, v are converted to fp16 once, with the kv head leading: qh [Hkv, T, G, D] (G = H / Hkv
   query heads share a kv head; for one kv head, the G * Tq rows of a query block are then one
   contiguous [G*Tq, D] matrix, row t*G + g), kh, vh [Hkv, S, D].
2. Queries go in blocks of Tq rows (`plan_blocks`): a block only scores the keys it may see
   (s_eff = pos0 + block end) and its fp16 score block [Hkv, Tq*G, ld] (ld = s_eff rounded up to
   64) stays under `score_bytes` (at least 16 rows; Tq a multiple of 16 except the last). Early
   blocks see fewer keys, so they take more rows. One score buffer, sized for the largest
   block, is allocated per call and reused.
3. Per block, three launches and no host synchronisation:
   - scores = Q_blk @ K^T / sqrt(D): one strided-batched cuBLAS GEMM (batch Hkv, M = G*Tq,
     N = s_eff, K = D), fp16 operands, **fp32 accumulation** (CUBLAS_COMPUTE_32F), fp16 output;
     the 1/sqrt(D) is cuBLAS's alpha (applied in fp32), so q itself is not rescaled;
   - `causal_softmax_f16` (attention.cu) in place: one thread block per row, the row's causal
     limit from its query position, running max and sum of exp in fp32, normalized fp16
     probabilities, 0 for keys past the query;
   - out_blk = P @ V: one strided-batched GEMM (batch Hkv, M = G*Tq, N = D, K = s_eff), fp16
     operands, fp32 accumulation and fp32 output, into oh [Hkv, T, G, D].
4. out [T, H, D] = oh transposed (one copy).

Why explicit cuBLAS (`cublasGemmStridedBatchedEx`, as `moe.gemm_nt`) rather than `cupy.matmul`
on float16: the compute type is stated here (CUBLAS_COMPUTE_32F: fp32 accumulation on the
tensor cores; not the _FAST_16F variant) instead of depending on CuPy's internal choice, the
score rows get a padded leading dimension, K is shared by the G heads of its group without a
broadcast copy, and P @ V writes float32 directly (fp16 A/B with fp32 C is one of the
CUBLAS_COMPUTE_32F type combinations cuBLAS lists for the Ex GEMMs).

Cost (counted FLOPs, causal): 4 * H * D * sum over queries of the keys they see
(`causal_flops`); the GEMMs also compute the masked upper triangle of each block's diagonal
square (Tq / 2 extra keys per row on average). Memory traffic is ~10 bytes per score (GEMM
write, two softmax reads, one write, the P @ V read), so for long rows this path is bound by
memory bandwidth, not by the tensor cores; a fused flash-style kernel would remove that traffic.

Device memory per call: qh (2*T*H*D bytes), kh and vh (2*S*Hkv*D each), the score buffer
(<= score_bytes unless 16 rows already exceed it), oh and out (4*T*H*D each).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from engine.kernels.source import cuda_source

DEFAULT_SCORE_BYTES = 256 << 20  # the fp16 score block of one query block stays under this
MIN_ROWS = 16  # queries per block at least (even past the budget)
ROW_ALIGN = 16  # queries per block: a multiple of this, except the last block
LD_ALIGN = 64  # score rows: leading dimension a multiple of this (16-byte rows, cuBLAS friendly)
_SOFTMAX_THREADS = 256  # must match SOFTMAX_THREADS in attention.cu


def _cupy() -> Any:
    import cupy

    return cupy


def kernel_source() -> str:
    """The CUDA C of the softmax kernel, as compiled."""
    return cuda_source("attention.cu")


@functools.cache
def _softmax_kernel() -> Any:
    cp = _cupy()
    module = cp.RawModule(code=kernel_source(), options=("-std=c++17",))
    return module.get_function("causal_softmax_f16")


def preload() -> None:
    """Compile and load the causal softmax now."""
    _softmax_kernel()


def _ld(s_eff: int) -> int:
    return -(-s_eff // LD_ALIGN) * LD_ALIGN


def block_score_bytes(n_rows: int, s_eff: int, n_head: int) -> int:
    """Bytes of the fp16 score block of n_rows queries over s_eff keys: [H, n_rows, ld]."""
    return 2 * n_head * n_rows * _ld(s_eff)


def plan_blocks(
    t: int, pos0: int, n_head: int, score_bytes: int = DEFAULT_SCORE_BYTES
) -> list[tuple[int, int, int]]:
    """Query blocks (a, b, ld) covering 0..t: queries a..b-1 over keys 0..pos0+b-1, score rows
    of leading dimension ld. Each block takes the most rows whose score block fits
    `score_bytes` (a multiple of ROW_ALIGN, at least MIN_ROWS), or all that are left."""
    blocks = []
    a = 0
    while a < t:
        left = t - a

        def fits(n: int, a: int = a) -> bool:
            return block_score_bytes(n, pos0 + a + n, n_head) <= score_bytes

        if fits(left):
            n = left
        else:
            lo, hi = 0, left // ROW_ALIGN  # largest k in [0, hi) with fits(k * ROW_ALIGN)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(mid * ROW_ALIGN):
                    lo = mid
                else:
                    hi = mid - 1
            n = min(left, max(MIN_ROWS, lo * ROW_ALIGN))
        blocks.append((a, a + n, _ld(pos0 + a + n)))
        a += n
    return blocks


def causal_flops(t: int, pos0: int, n_head: int, d: int) -> float:
    """FLOPs of causal attention counted on visible keys only: 4 * H * D * sum_i (pos0 + i + 1)
    (2 for Q K^T and 2 for P V per query, key and dimension)."""
    visible = t * pos0 + t * (t + 1) // 2
    return 4.0 * n_head * d * visible


@functools.cache
def _scalar(x: float) -> np.ndarray:
    """A float32 host scalar for cuBLAS (kept alive for the process, as moe.py's _ONE)."""
    return np.array([x], dtype=np.float32)


def _gemm(
    op_a: int, op_b: int, m: int, n: int, k: int, alpha: float,
    a: tuple[int, int, int, int], b: tuple[int, int, int, int], c: tuple[int, int, int, int],
    batch: int,
) -> None:  # fmt: skip
    """C[i] = alpha * op(A[i]) @ op(B[i]) for i < batch, column-major as cuBLAS sees it;
    a, b, c = (device pointer, CUDA data type, leading dimension, batch stride in elements).
    fp32 accumulation (CUBLAS_COMPUTE_32F), host scalars, the current CuPy stream."""
    cp = _cupy()
    from cupy_backends.cuda.libs import cublas

    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    alpha_h, beta_h = _scalar(alpha), _scalar(0.0)
    cublas.gemmStridedBatchedEx(
        handle, op_a, op_b, m, n, k,
        alpha_h.ctypes.data, a[0], a[1], a[2], a[3],
        b[0], b[1], b[2], b[3],
        beta_h.ctypes.data, c[0], c[1], c[2], c[3],
        batch, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip


def _op(transpose: bool) -> int:
    from cupy_backends.cuda.libs import cublas

    return cublas.CUBLAS_OP_T if transpose else cublas.CUBLAS_OP_N


def _types() -> tuple[int, int]:
    cp = _cupy()
    return cp.cuda.runtime.CUDA_R_16F, cp.cuda.runtime.CUDA_R_32F


def gqa_dims(q: Any, k: Any, v: Any, pos0: int) -> tuple[int, int, int]:
    """Checked shapes of a causal GQA call (q [T, H, D], k, v [S, Hkv, D], S >= pos0 + T):
    (Hkv, G = H / Hkv, keys visible to the last query pos0 + T)."""
    t, n_head, d = q.shape
    n_kv = k.shape[1]
    s = pos0 + t
    shapes = (q.shape, k.shape, v.shape, pos0)
    assert k.shape[0] >= s and k.shape[2] == d and v.shape == k.shape, shapes
    assert n_head % n_kv == 0, f"{n_head} query heads over {n_kv} kv heads"
    return n_kv, n_head // n_kv, s


def fp16_kv_leading(
    q: Any, k: Any, v: Any, s: int, transpose_v: bool = False
) -> tuple[Any, Any, Any]:
    """fp16 copies with the kv head leading: qh [Hkv, T, G, D] (for one kv head its G*T rows,
    row t*G + g, form one matrix), kh, vh [Hkv, s, D] (keys 0..s-1 only).

    transpose_v: the third copy is V transposed instead, vt [Hkv, D, s8] with vt[h, :, j] =
    v[j, h] for keys j < s, and s8 = s rounded up to a multiple of 8 so that its rows are
    16-byte aligned (columns s..s8-1 are not initialised)."""
    cp = _cupy()
    t, n_head, d = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    qh = cp.empty((n_kv, t, group, d), dtype=cp.float16)  # [Hkv, T, G, D]
    cp.copyto(qh, q.reshape(t, n_kv, group, d).transpose(1, 0, 2, 3))
    kh = cp.empty((n_kv, s, d), dtype=cp.float16)  # [Hkv, S, D]
    cp.copyto(kh, k[:s].transpose(1, 0, 2))
    if transpose_v:
        vt = cp.empty((n_kv, d, -(-s // 8) * 8), dtype=cp.float16)  # [Hkv, D, S8]
        cp.copyto(vt[:, :, :s], v[:s].transpose(1, 2, 0))
        return qh, kh, vt
    vh = cp.empty((n_kv, s, d), dtype=cp.float16)  # [Hkv, S, D]
    cp.copyto(vh, v[:s].transpose(1, 0, 2))
    return qh, kh, vh


def causal_attention(
    q: Any, k: Any, v: Any, pos0: int, score_bytes: int = DEFAULT_SCORE_BYTES
) -> Any:
    """Causal GQA on the GPU (see the module docstring).

    q: [T, H, D] float32 (or float16); k, v: [S, Hkv, D] float32 or float16 for positions
    0..S-1, S >= pos0 + T (keys past pos0 + T - 1 are never visible and are not read).
    Query i sits at position pos0 + i. Returns float32 [T, H, D].
    """
    cp = _cupy()
    t, n_head, d = q.shape
    n_kv, group, s = gqa_dims(q, k, v, pos0)
    out = cp.empty((t, n_head, d), dtype=cp.float32)
    if t == 0:
        return out
    f16, f32 = _types()
    blocks = plan_blocks(t, pos0, n_head, score_bytes)

    qh, kh, vh = fp16_kv_leading(q, k, v, s)
    oh = cp.empty((n_kv, t, group, d), dtype=cp.float32)  # [Hkv, T, G, D]
    cap = max((b - a) * group * ld for a, b, ld in blocks)  # score elements per kv head
    scores = cp.empty(n_kv * cap, dtype=cp.float16)  # per block: [Hkv, Tq*G, ld]

    softmax = _softmax_kernel()
    alpha = 1.0 / math.sqrt(d)
    op_n, op_t = _op(False), _op(True)
    q_ptr, k_ptr, v_ptr = qh.data.ptr, kh.data.ptr, vh.data.ptr
    o_ptr, s_ptr = oh.data.ptr, scores.data.ptr
    for a, b, ld in blocks:
        rows = (b - a) * group  # score rows per kv head: (t, g) for t in a..b-1
        s_eff = pos0 + b  # keys this block may see
        # scores[h] [rows, ld] = qh[h, a:b] [rows, D] @ kh[h, :s_eff].T; column-major:
        # C^T [s_eff, rows] = (kh[h] as D x s_eff)^T @ (qh[h, a:b] as D x rows)
        _gemm(
            op_t, op_n, s_eff, rows, d, alpha,
            (k_ptr, f16, d, s * d),
            (q_ptr + a * group * d * 2, f16, d, t * group * d),
            (s_ptr, f16, ld, rows * ld),
            n_kv,
        )  # fmt: skip
        softmax(
            (n_kv * rows,),
            (_SOFTMAX_THREADS,),
            (scores, np.int32(ld), np.int32(s_eff), np.int32(rows), np.int32(group),
             np.int32(pos0 + a)),
        )  # fmt: skip
        # oh[h, a:b] [rows, D] = P[h] [rows, s_eff] @ vh[h, :s_eff]; column-major:
        # C^T [D, rows] = (vh[h] as D x s_eff) @ (P[h] as s_eff x rows, ld)
        _gemm(
            op_n, op_n, d, rows, s_eff, 1.0,
            (v_ptr, f16, d, s * d),
            (s_ptr, f16, ld, rows * ld),
            (o_ptr + a * group * d * 4, f32, d, t * group * d),
            n_kv,
        )  # fmt: skip
    del scores, qh, kh, vh  # back to the pool before the output copy
    cp.copyto(out.reshape(t, n_kv, group, d), oh.transpose(1, 0, 2, 3))
    return out
