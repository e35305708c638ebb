"""Causal grouped-query flash attention for the CUDA prompt path: one fused kernel, flash.cu
(FlashAttention-2 on `mma.sync`, any sm_80+ GPU) or flash90.cu (Hopper `wgmma`, compute
capability 9.0).

`flash_attention(q [T, H, D], k, v [S, Hkv, D], pos0)` -> float32 [T, H, D], the contract of
`engine.kernels.attention.causal_attention` (query i sits at position pos0 + i and sees keys
0..pos0 + i), without materialising the scores.

Which kernel runs (`kernel_for`): "sm90a" on a GPU of compute capability 9.0 (H100, H200) for
D = 64 or 128 when NVRTC is 13 or newer, else "fa2"; `STRATA_FLASH=fa2` forces "fa2" (for A/B
comparisons). Both compute the same function with the same roundings (fp16 q, k, v and P,
everything else fp32), not bit for bit the same (the sums run in other orders).

Common to both: q, k, v are converted to fp16 once, kv head leading: qh [Hkv, T*G, D]
(G = H / Hkv; row r = t*G + g, so the G heads sharing a kv head are adjacent rows of one
matrix), kh [Hkv, S', D] with S' = pos0 + T (keys past S' - 1 are never visible and are not
copied). A block walks its visible keys in tiles; per tile, S = Q K^T with fp32 accumulation,
keys past each row's position masked (only in tiles that cross one), a running max and sum of
exp2 per row in fp32 (online softmax, rescaling the fp32 O accumulator), O += P V with P
rounded to fp16 from the score registers. The output O / sum is written once, in float32, to
out[t, hk*G + g]. Row tiles are launched last-first, so the blocks with the most keys start
first.

"fa2" (flash.cu, FlashAttention-2): vh [Hkv, S', D]. One block (4 warps) takes 64 rows of one
kv head, a warp 16 rows, with the warp's Q in registers; key tiles of 64 (32 for D > 128)
staged in shared memory by cp.async (V of a tile loads while Q K^T runs, K of the next tile
while P V runs); fp16 `mma.sync` m16n8k16. Needs an sm_80 or newer GPU.

"sm90a" (flash90.cu: FlashAttention-3's intra-warpgroup order, without its producer
warpgroup or TMA): V goes transposed, vt [Hkv, D, S8] (S8 = S' rounded up to 8: 16-byte rows),
so that both products read a K-major B operand. One block (2 warpgroups, 256 threads) takes 128
rows of one kv head, a warpgroup 64; key tiles of 128 go to shared memory by cp.async (Q once,
two stages each of K and V^T, in the 128-byte swizzled layout of wgmma; mbarriers hand the
stages between the warpgroups, so these need not run in step); S = Q K^T by `wgmma`
m64n128k16 from shared memory, O += P V by `wgmma` with P from registers; each tile's softmax
runs while the tensor cores do the previous tile's P V. wgmma needs the arch-specific target
sm_90a: NVRTC gets `-arch=sm_90a`; CuPy appends its own `-arch=sm_90`, which NVRTC 13 takes as
the same architecture and keeps the 'a' of, while NVRTC 12 rejects a second -arch (hence
NVRTC 13+). `wgmma_gemm_test` runs its GEMM building blocks alone, for tests.

Cost: 4 * H * D * (keys each query sees) FLOPs (`attention.causal_flops`) plus the masked parts
of the tiles that cross a row's last key; memory traffic is the fp16 copies, each block's reads
of K and V for its keys (from L2 for all but the first block of a kv head), and the float32
output, with no score traffic, so long rows are bound by the tensor cores rather than by memory
bandwidth as in the cuBLAS path.

Device memory per call: qh (2*T*H*D bytes), kh and vh (or vt) (2*(pos0+T)*Hkv*D each, vt
rounded up to 8 keys), out (4*T*H*D); nothing per score.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.kernels.attention import fp16_kv_leading, gqa_dims
from engine.kernels.source import cuda_source

_THREADS = 128  # must match FA_THREADS in flash.cu
_ROWS = 64  # rows of qh per block; must match FA_ROWS in flash.cu
MAX_D = 256  # head sizes: multiples of 16 up to this (registers: D/2 + D/4 floats a lane)

_THREADS90 = 256  # must match F9_THREADS in flash90.cu
_ROWS90 = 128  # rows of qh per block; must match F9_ROWS in flash90.cu
_KEYS90 = 128  # keys per tile; must match F9_KEYS in flash90.cu
SM90_HEAD_SIZES = (64, 128)  # head sizes of the sm90a kernel
KERNELS = ("fa2", "sm90a")
ENV = "STRATA_FLASH"  # "fa2": always the FA2 kernel; unset, "" or "auto": `kernel_for` picks


def supported(d: int) -> bool:
    """Whether the flash path handles head size d (a multiple of 16, 16..256): the FA2 kernel
    takes all of these, the sm90a kernel SM90_HEAD_SIZES."""
    return d % 16 == 0 and 16 <= d <= MAX_D


def kernel_source() -> str:
    """The CUDA C of the FA2 kernel, as compiled."""
    return cuda_source("flash.cu")


def kernel_source90() -> str:
    """The CUDA C of the sm90a kernel (and its test kernel), as compiled: the Hopper building
    blocks (hopper.cuh: swizzled tiles, descriptors, mbarriers, wgmma) and flash90.cu."""
    return cuda_source("hopper.cuh", "flash90.cu")


def sm90a_available() -> bool:
    """Whether the current device and NVRTC can run the sm90a kernel: compute capability 9.0
    exactly (sm_90a code runs on no other) and NVRTC 13+ (see the module docstring)."""
    import cupy

    nvrtc = cupy.cuda.nvrtc.getVersion()
    return cupy.cuda.Device().compute_capability == "90" and nvrtc >= (13, 0)


def env_problem(env: Mapping[str, str] | None = None) -> str | None:
    """What is wrong with STRATA_FLASH in `env` (default: the process's), or None. The engine
    checks it at start on CUDA, so a typo is one line before the model loads."""
    choice = (os.environ if env is None else env).get(ENV, "")
    if choice in ("", "auto", "fa2"):
        return None
    return f"{ENV}={choice!r} is not a flash kernel choice; use fa2 or auto (or unset it)"


def kernel_for(d: int) -> str:
    """The kernel `flash_attention` runs for head size d: "sm90a" or "fa2" (module docstring)."""
    problem = env_problem()
    if problem is not None:
        raise ValueError(problem)
    choice = os.environ.get(ENV, "")
    if choice != "fa2" and d in SM90_HEAD_SIZES and sm90a_available():
        return "sm90a"
    return "fa2"


@functools.cache
def _kernel(d: int) -> Any:
    import cupy

    name = f"flash_attn<{d}>"
    module = cupy.RawModule(code=kernel_source(), options=("-std=c++17",), name_expressions=[name])
    return module.get_function(name)


def _smem90(d: int) -> int:
    """Dynamic shared memory of flash90<d>: Smem90<D>::TOTAL in flash90.cu (1024 alignment
    slack, Q, 2 stages of K and of V^T, 8 mbarriers)."""
    return 1024 + 2 * (_ROWS90 * d + 2 * _KEYS90 * d + 2 * d * _KEYS90) + 64


def _smem90_test(d: int) -> int:
    """Dynamic shared memory of wgmma_gemm_test<d>: SmemTest90<D>::TOTAL in flash90.cu."""
    return 1024 + 2 * (64 * d + _KEYS90 * d + d * _KEYS90)


@functools.cache
def _module90() -> Any:
    import cupy

    names = [f"{k}<{d}>" for k in ("flash90", "wgmma_gemm_test") for d in SM90_HEAD_SIZES]
    return cupy.RawModule(
        code=kernel_source90(), options=("-std=c++17", "-arch=sm_90a"), name_expressions=names
    )


@functools.cache
def _kernel90(name: str, smem: int) -> Any:
    """A kernel of flash90.cu allowed `smem` bytes of dynamic shared memory (past 48 KiB)."""
    kernel = _module90().get_function(name)
    kernel.max_dynamic_shared_size_bytes = smem
    return kernel


def preload() -> None:
    """Where the sm90a kernel runs (Hopper, NVRTC 13+, not STRATA_FLASH=fa2), compile and load
    its module now: every head size is in it. The FA2 kernel is one module per head size."""
    if env_problem() is None and os.environ.get(ENV, "") != "fa2" and sm90a_available():
        _module90().get_function(f"flash90<{SM90_HEAD_SIZES[0]}>")


def flash_attention(q: Any, k: Any, v: Any, pos0: int) -> Any:
    """Causal GQA on the GPU in one fused kernel (see the module docstring).

    q: [T, H, D] float32 (or float16); k, v: [S, Hkv, D] float32 or float16 for positions
    0..S-1, S >= pos0 + T (keys past pos0 + T - 1 are never read). Query i sits at position
    pos0 + i. Returns float32 [T, H, D].
    """
    if kernel_for(q.shape[2]) == "sm90a":
        return flash_attention_sm90a(q, k, v, pos0)
    return flash_attention_fa2(q, k, v, pos0)


def flash_attention_fa2(q: Any, k: Any, v: Any, pos0: int) -> Any:
    """`flash_attention` on the FA2 kernel (flash.cu), whatever the device."""
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


def flash_attention_sm90a(q: Any, k: Any, v: Any, pos0: int) -> Any:
    """`flash_attention` on the sm90a kernel (flash90.cu): needs `sm90a_available()` and D in
    SM90_HEAD_SIZES."""
    import cupy as cp

    t, n_head, d = q.shape
    n_kv, group, s = gqa_dims(q, k, v, pos0)
    assert d in SM90_HEAD_SIZES, f"head size {d}: flash90 takes {SM90_HEAD_SIZES}"
    out = cp.empty((t, n_head, d), dtype=cp.float32)
    if t == 0:
        return out
    qh, kh, vt = fp16_kv_leading(q, k, v, s, transpose_v=True)  # vt [Hkv, D, S8]
    rows = t * group
    scale_log2 = np.float32(math.log2(math.e) / math.sqrt(d))
    smem = _smem90(d)
    _kernel90(f"flash90<{d}>", smem)(
        (-(-rows // _ROWS90), n_kv),
        (_THREADS90,),
        (qh, kh, vt, out, np.int32(rows), np.int32(group), np.int32(s), np.int32(vt.shape[2]),
         np.int32(pos0), scale_log2),
        shared_mem=smem,
    )  # fmt: skip
    return out


def wgmma_gemm_test(q: Any, k: Any, vt: Any) -> tuple[Any, Any]:
    """The sm90a kernel's GEMM building blocks alone (flash90.cu `wgmma_gemm_test`), for tests:
    q [64, D], k [128, D], vt [D, 128] (fp16, D in SM90_HEAD_SIZES) -> s = q k^T [64, 128] and
    o = fp16(s) vt^T [64, D], float32, through the same shared-memory layout, descriptors and
    register fragments as the attention kernel."""
    import cupy as cp

    d = q.shape[1]
    assert q.shape == (64, d) and k.shape == (_KEYS90, d) and vt.shape == (d, _KEYS90), (
        q.shape, k.shape, vt.shape,
    )  # fmt: skip
    q, k, vt = (cp.ascontiguousarray(x, dtype=cp.float16) for x in (q, k, vt))
    s = cp.empty((64, _KEYS90), dtype=cp.float32)
    o = cp.empty((64, d), dtype=cp.float32)
    smem = _smem90_test(d)
    _kernel90(f"wgmma_gemm_test<{d}>", smem)((1,), (128,), (q, k, vt, s, o), shared_mem=smem)
    return s, o
