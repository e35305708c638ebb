"""Grouped-query causal attention over a KV cache, with Qwen3's per-head q/k RMSNorm and NEOX RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.backend.base import Backend
from engine.gguf.hparams import HParams
from engine.kv import KVCache


@dataclass
class AttentionWeights:
    """Dense attention weights of one block, on the backend."""

    norm: Any  # [d]
    wq: Any  # [H*D, d]
    wk: Any  # [Hkv*D, d]
    wv: Any  # [Hkv*D, d]
    wo: Any  # [d, H*D]
    q_norm: Any  # [D]
    k_norm: Any  # [D]


def attention_block(
    be: Backend, hp: HParams, w: AttentionWeights, x: Any, pos0: int, kv: KVCache, layer: int
) -> Any:
    """x: [T, d] residual stream -> [T, d] attention output; writes this chunk's K/V at pos0."""
    t = x.shape[0]
    h = be.rms_norm(x, w.norm, hp.rms_eps)  # [T, d]
    q = be.linear(h, w.wq).reshape(t, hp.n_head, hp.head_dim)  # [T, H, D]
    k = be.linear(h, w.wk).reshape(t, hp.n_head_kv, hp.head_dim)  # [T, Hkv, D]
    v = be.linear(h, w.wv).reshape(t, hp.n_head_kv, hp.head_dim)  # [T, Hkv, D]
    q = be.rms_norm(q, w.q_norm, hp.rms_eps)
    k = be.rms_norm(k, w.k_norm, hp.rms_eps)
    q = be.rope(q, pos0, hp.rope_base)  # q, k: fresh arrays from rms_norm
    k = be.rope(k, pos0, hp.rope_base)
    kv.write(layer, pos0, k, v)
    k_all, v_all = kv.read(layer, pos0 + t)  # [S, Hkv, D] with S = pos0 + T
    out = be.attention(q, k_all, v_all, pos0)  # [T, H, D]
    return be.linear(out.reshape(t, hp.q_dim), w.wo)  # [T, d]
