"""Grouped-query causal attention over a KV cache: q/k/v projections (glm4moe's with biases),
per-head q/k RMSNorm where the model has it (Qwen3, GLM-4.5), NEOX RoPE over all of a head's
dims or its first `n_rot` (GLM's partial RoPE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.backend.base import Backend, Position
from engine.config import DECODE_ROWS
from engine.gguf.hparams import HParams
from engine.gguf.quant import matrix_rows
from engine.kv import KVCache


@dataclass
class AttentionWeights:
    """Dense attention weights of one block, on the backend."""

    norm: Any  # [d]
    wqkv: Any  # [H*D + 2*Hkv*D, d]: q, k and v stacked by rows (array or QuantMatrix)
    wo: Any  # [d, H*D]
    q_norm: Any  # [D], or None (a model without q/k norms)
    k_norm: Any  # [D], or None
    bias: Any = None  # [H*D + 2*Hkv*D]: q, k and v biases stacked, or None


def project_qkv(be: Backend, hp: HParams, wqkv: Any, h: Any, bias: Any = None
                ) -> tuple[Any, Any, Any]:
    """h [T, d] -> q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], contiguous, plus `bias` (stacked
    like the weight) where given. A decode step's few rows take the stacked weight in one
    launch; a prompt chunk takes one GEMM per projection on its rows of the weight (no
    strided copy of a chunk-sized q)."""
    t, q_dim, kv_dim = h.shape[0], hp.q_dim, hp.kv_dim
    cuts = ((0, q_dim, hp.n_head), (q_dim, q_dim + kv_dim, hp.n_head_kv),
            (q_dim + kv_dim, q_dim + 2 * kv_dim, hp.n_head_kv))
    if t <= DECODE_ROWS:
        qkv = be.linear(h, wqkv)  # [T, H*D + 2*Hkv*D]
        if bias is not None:
            qkv += bias
        return tuple(be.xp.ascontiguousarray(qkv[:, a:b]).reshape(t, n, hp.head_dim)  # type: ignore[return-value]
                     for a, b, n in cuts)
    out = []
    for a, b, n in cuts:
        y = be.linear(h, matrix_rows(wqkv, a, b))  # [T, b - a]
        if bias is not None:
            y += bias[a:b]
        out.append(y.reshape(t, n, hp.head_dim))
    return tuple(out)  # type: ignore[return-value]


def attention_block(
    be: Backend, hp: HParams, w: AttentionWeights, x: Any, pos: Position, kv: KVCache, layer: int
) -> Any:
    """x: [T, d] residual stream -> [T, d] attention output; writes these rows' K/V at pos."""
    q, k, v = qkv_rows(be, hp, w, x, pos)
    out = kv.attend(layer, pos, q, k, v)  # [T, H, D]
    return be.linear(out.reshape(x.shape[0], hp.q_dim), w.wo)  # [T, d]


def qkv_rows(be: Backend, hp: HParams, w: AttentionWeights, x: Any, pos: Position
             ) -> tuple[Any, Any, Any]:
    """Rows x [T, d] -> q [T, H, D], k [T, Hkv, D] normed and rotated at pos.., v [T, Hkv, D]."""
    h = be.rms_norm(x, w.norm, hp.rms_eps)  # [T, d]
    q, k, v = project_qkv(be, hp, w.wqkv, h, w.bias)  # [T, H, D], [T, Hkv, D], [T, Hkv, D]
    if w.q_norm is not None:
        q = be.rms_norm(q, w.q_norm, hp.rms_eps)
        k = be.rms_norm(k, w.k_norm, hp.rms_eps)
    q = be.rope(q, pos, hp.rope_base, hp.n_rot)  # q, k: fresh arrays (rms_norm's, or the
    k = be.rope(k, pos, hp.rope_base, hp.n_rot)  # projection's own)
    return q, k, v
