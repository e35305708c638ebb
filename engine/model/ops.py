"""Elementwise and normalisation ops shared by the transformer and the MTP block."""

from __future__ import annotations

from typing import Any

GEMV_ROWS = 8  # on CUDA, up to this many rows go through the fused fp16 GEMV (one launch)


def linear(xp: Any, x: Any, w: Any) -> Any:
    """x [.., n_in] @ w[n_out, n_in]^T in the weight's dtype (fp16 on CUDA), float32 out.

    On CUDA a few rows (decode steps) take the fused GEMV kernel: fp16 weights read once,
    float32 products and output, one launch instead of cast + cuBLAS + cast."""
    if (xp.__name__ == "cupy" and x.ndim == 2 and x.shape[0] <= GEMV_ROWS
            and w.dtype == xp.float16 and w.flags.c_contiguous):
        from gguf import GGMLQuantizationType

        from engine.kernels.dequant import gemv

        return gemv(w.reshape(-1).view(xp.uint8), GGMLQuantizationType.F16, w.shape, x)
    if x.dtype != w.dtype:
        return (x.astype(w.dtype) @ w.T).astype(xp.float32)
    return x @ w.T


def rms_norm(xp: Any, x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight (one fused launch on
    CUDA, engine/kernels/fused.py)."""
    if xp.__name__ == "cupy" and x.dtype == xp.float32:
        from engine.kernels.fused import rms_norm as fused

        return fused(x, weight, eps)
    ms = xp.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / xp.sqrt(ms + eps)) * weight


def silu(xp: Any, x: Any) -> Any:
    return x / (1.0 + xp.exp(-x))


def softmax(xp: Any, x: Any, axis: int = -1) -> Any:
    m = xp.max(x, axis=axis, keepdims=True)
    e = xp.exp(x - m)
    return e / xp.sum(e, axis=axis, keepdims=True)


def rope_at(xp: Any, x: Any, pos0: int, base: float) -> Any:
    """`rope_neox` at positions pos0..pos0+T-1; on CUDA one fused launch, in place when x is a
    contiguous float32 array (callers pass a fresh one)."""
    if xp.__name__ == "cupy":
        from engine.kernels.fused import rope_neox_

        return rope_neox_(xp.ascontiguousarray(x, dtype=xp.float32), pos0, base)
    return rope_neox(xp, x, xp.arange(pos0, pos0 + x.shape[0]), base)


def rope_neox(xp: Any, x: Any, positions: Any, base: float) -> Any:
    """NEOX-style rotary embedding (rotate halves), as llama.cpp's qwen3moe graph uses.

    x: [T, H, D]; positions: [T] int.
    """
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-xp.arange(0, half, dtype=xp.float32) * 2.0 / d)  # [D/2]
    ang = positions.astype(xp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = xp.cos(ang)[:, None, :]  # [T, 1, D/2]
    sin = xp.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
