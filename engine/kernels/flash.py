"""Causal grouped-query flash attention for the CUDA prompt path: one fused kernel (flash.cu).

`flash_attention(q [T, H, D], k, v [S, Hkv, D], pos0)` -> float32 [T, H, D], the contract of
`engine.kernels.attention.causal_attention` (query i sits at position pos0 + i and sees keys
0..pos0 + i), without materialising the scores.

Algorithm (FlashAttention-2 forward): q, k, v are converted to fp16 once, kv head leading:
qh [Hkv, T*G, D] (G = H / Hkv; row r = t*G + g, so the G heads sharing a kv head are adjacent
rows of one matrix), kh, vh [Hkv, S', D] with S' = pos0 + T (keys past S' - 1 are never
visible and are not copied). One thread block (4 warps) takes 64 rows of one kv head, a warp 16
rows, with the warp's Q kept in registers. The block walks its visible keys in tiles of 64 (32
for D > 128), staged in shared memory by cp.async (V of a tile loads while Q K^T runs, K of
the next tile while P V runs); per tile each warp computes its 16 x 64 scores with fp16
`mma.sync` (fp32 accumulation), masks keys past each row's position (only in tiles that
cross one), keeps a running max and sum of exp2 per row in fp32 (online softmax, rescaling the
fp32 O accumulator), and adds P V with P rounded to fp16 straight from the score registers.
The output O / sum is written once, in float32, to out[t, hk*G + g]. Row tiles are launched
last-first, so the blocks with the most keys start first.

Cost: 4 * H * D * (keys each query sees) FLOPs (`attention.causal_flops`) plus the masked part
of each warp's last tile (< 64 keys per row); memory traffic is the fp16 copies, each block's
reads of K and V for its keys (from L2 for all but the first block of a kv head), and the
float32 output, with no score traffic, so long rows are bound by the tensor cores rather
than by memory bandwidth as in the cuBLAS path.

Device memory per call: qh (2*T*H*D bytes), kh and vh (2*(pos0+T)*Hkv*D each), out (4*T*H*D);
nothing per score. Needs an sm_80 or newer GPU (mma.sync m16n8k16 f16, cp.async).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from engine.kernels.attention import fp16_kv_leading, gqa_dims
from engine.kernels.source import cuda_source

_THREADS = 128  # must match FA_THREADS in flash.cu
_ROWS = 64  # rows of qh per block; must match FA_ROWS in flash.cu
MAX_D = 256  # head sizes: multiples of 16 up to this (registers: D/2 + D/4 floats a lane)


def supported(d: int) -> bool:
    """Whether the kernel handles head size d (a multiple of 16, 16..256)."""
    return d % 16 == 0 and 16 <= d <= MAX_D


def kernel_source() -> str:
    """The CUDA C of the flash kernel, as compiled."""
    return cuda_source("flash.cu")


@functools.cache
def _kernel(d: int) -> Any:
    import cupy

    name = f"flash_attn<{d}>"
    module = cupy.RawModule(code=kernel_source(), options=("-std=c++17",), name_expressions=[name])
    return module.get_function(name)


def flash_attention(q: Any, k: Any, v: Any, pos0: int) -> Any:
    """Causal GQA on the GPU in one fused kernel (see the module docstring).

    q: [T, H, D] float32 (or float16); k, v: [S, Hkv, D] float32 or float16 for positions
    0..S-1, S >= pos0 + T (keys past pos0 + T - 1 are never visible and are not read).
    Query i sits at position pos0 + i. Returns float32 [T, H, D].
    """
    import cupy as cp

    t, n_head, d = q.shape
    n_kv, group, s = gqa_dims(q, k, v, pos0)
    assert supported(d), f"head size {d}: flash_attn needs a multiple of 16 up to {MAX_D}"
    out = cp.empty((t, n_head, d), dtype=cp.float32)
    if t == 0:
        return out
    qh, kh, vh = fp16_kv_leading(q, k, v, s)  # qh [Hkv, T*G, D] (row t*G + g), kh, vh [Hkv, S', D]
    rows = t * group
    scale_log2 = np.float32(math.log2(math.e) / math.sqrt(d))  # softmax in base 2: exp2f
    _kernel(d)(
        (-(-rows // _ROWS), n_kv),
        (_THREADS,),
        (qh, kh, vh, out, np.int32(rows), np.int32(group), np.int32(s), np.int32(pos0),
         scale_log2),
    )  # fmt: skip
    return out
