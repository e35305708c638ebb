"""Grouped-query causal attention over a KV cache, with Qwen3's per-head q/k RMSNorm and NEOX RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.gguf.hparams import HParams
from engine.kv import KVCache
from engine.model.ops import linear, rms_norm, rope_at

QUERY_BLOCK = 512  # queries per score block at most
SCORE_BUDGET_BYTES = 64 << 20  # the [H, Tq, S] float32 score block stays under this


@dataclass
class AttentionWeights:
    """Dense attention weights of one block, float32 on the backend."""

    norm: Any  # [d]
    wq: Any  # [H*D, d]
    wk: Any  # [Hkv*D, d]
    wv: Any  # [Hkv*D, d]
    wo: Any  # [d, H*D]
    q_norm: Any  # [D]
    k_norm: Any  # [D]


def attention_block(
    xp: Any, hp: HParams, w: AttentionWeights, x: Any, pos0: int, kv: KVCache, layer: int
) -> Any:
    """x: [T, d] residual stream -> [T, d] attention output; writes this chunk's K/V at pos0."""
    t = x.shape[0]
    h = rms_norm(xp, x, w.norm, hp.rms_eps)  # [T, d]
    q = linear(xp, h, w.wq).reshape(t, hp.n_head, hp.head_dim)  # [T, H, D]
    k = linear(xp, h, w.wk).reshape(t, hp.n_head_kv, hp.head_dim)  # [T, Hkv, D]
    v = linear(xp, h, w.wv).reshape(t, hp.n_head_kv, hp.head_dim)  # [T, Hkv, D]
    q = rms_norm(xp, q, w.q_norm, hp.rms_eps)
    k = rms_norm(xp, k, w.k_norm, hp.rms_eps)
    q = rope_at(xp, q, pos0, hp.rope_base)  # q, k: fresh arrays from rms_norm
    k = rope_at(xp, k, pos0, hp.rope_base)
    kv.write(layer, pos0, k, v)
    k_all, v_all = kv.read(layer, pos0 + t)  # [S, Hkv, D] with S = pos0 + T
    if t > 1 and xp.__name__ == "cupy":  # prompt chunk on the GPU: tensor-core kernels
        from engine.kernels.attention import causal_attention
        from engine.kernels.flash import flash_attention, supported

        # one fused flash kernel; head sizes it does not take: cuBLAS GEMMs + fused softmax
        attend = flash_attention if supported(hp.head_dim) else causal_attention
        out = attend(q, k_all, v_all, pos0)  # [T, H, D] float32
    else:
        out = causal_gqa(xp, q, k_all, v_all, pos0)  # [T, H, D]
    return linear(xp, out.reshape(t, hp.q_dim), w.wo)  # [T, d]


def causal_gqa(xp: Any, q: Any, k: Any, v: Any, pos0: int) -> Any:
    """q: [T, H, D]; k, v: [S, Hkv, D] for positions 0..S-1; query i sits at pos0 + i.

    Queries go in blocks; a block only scores the keys it may see (0..its last position), and
    only the block's own diagonal square needs a mask.
    """
    t, n_head, d = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    scale = 1.0 / float(d) ** 0.5
    qg = q.reshape(t, n_kv, group, d).transpose(1, 2, 0, 3) * scale  # [Hkv, G, T, D]
    kt = k.transpose(1, 2, 0)  # [Hkv, D, S]
    vh = v.transpose(1, 0, 2)  # [Hkv, S, D]
    out = xp.empty((n_kv, group, t, d), dtype=xp.float32)
    block = max(16, min(QUERY_BLOCK, SCORE_BUDGET_BYTES // (4 * n_head * (pos0 + t))))
    for a in range(0, t, block):
        b = min(t, a + block)
        s_eff = pos0 + b  # keys this block may see
        scores = qg[:, :, a:b] @ kt[:, None, :, :s_eff]  # [Hkv, G, Tq, s_eff]
        diag = xp.arange(pos0 + a, s_eff)
        future = diag[None, :] > diag[:, None]  # [Tq, Tq] within the block's own keys
        scores[..., pos0 + a :] = xp.where(future, -xp.inf, scores[..., pos0 + a :])
        scores -= xp.max(scores, axis=-1, keepdims=True)
        xp.exp(scores, out=scores)
        scores /= xp.sum(scores, axis=-1, keepdims=True)  # softmax over visible keys
        out[:, :, a:b] = scores @ vh[:, None, :s_eff]  # [Hkv, G, Tq, D]
    return out.transpose(2, 0, 1, 3).reshape(t, n_head, d)  # [T, H, D]
