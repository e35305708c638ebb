"""The model's device ops written once in array code (NumPy's API, any `xp`).

The simulated device runs them on NumPy; the CUDA backend (engine/backend/cuda_ops.py) runs its
kernels where one applies and these, on CuPy, where none does. They are also the references
the kernels are tested against (tests/test_gpu_*.py).

The functions take `xp` first; `ArrayOps` binds them to a backend's `xp` as the ops of the
`Backend` protocol (engine/backend/base.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.backend.base import DeviceArray, DevicePosition, ExpertProvider, Position, Routing
from engine.gguf.quant import QuantMatrix, QuantStack, dequantize_bytes

QUERY_BLOCK = 512  # queries per score block at most (`causal_gqa`)
SCORE_BUDGET_BYTES = 64 << 20  # the [H, Tq, S] float32 score block stays under this
KV_KINDS = ("f16", "int8", "q4_0")
Q4_BLOCK = 32  # values per q4_0 block of a KV row


def linear(xp: ModuleType, x: Any, w: Any) -> Any:
    """x [.., n_in] @ w [n_out, n_in]^T in the weight's dtype (fp16 on CUDA), float32 out."""
    if x.dtype != w.dtype:
        return (x.astype(w.dtype) @ w.T).astype(xp.float32)
    return x @ w.T


def rms_norm(xp: ModuleType, x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    ms = xp.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / xp.sqrt(ms + eps)) * weight


def silu(xp: ModuleType, x: Any) -> Any:
    return x / (1.0 + xp.exp(-x))


def softmax(xp: ModuleType, x: Any, axis: int = -1) -> Any:
    m = xp.max(x, axis=axis, keepdims=True)
    e = xp.exp(x - m)
    return e / xp.sum(e, axis=axis, keepdims=True)


def rope_neox(xp: ModuleType, x: Any, positions: Any, base: float, n_rot: int = 0) -> Any:
    """NEOX-style rotary embedding (rotate halves), as llama.cpp's qwen3moe and glm4moe graphs
    use; `n_rot`: only the first n_rot dims, the rest pass through (partial RoPE).

    x: [T, H, D]; positions: [T] int.
    """
    if n_rot and n_rot < x.shape[-1]:
        return xp.concatenate([rope_neox(xp, x[..., :n_rot], positions, base), x[..., n_rot:]],
                              axis=-1)
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-xp.arange(0, half, dtype=xp.float32) * 2.0 / d)  # [D/2]
    ang = positions.astype(xp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = xp.cos(ang)[:, None, :]  # [T, 1, D/2]
    sin = xp.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_gqa(xp: ModuleType, q: Any, k: Any, v: Any, pos0: int) -> Any:
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


def route_topk(xp: ModuleType, logits: Any, routing: Routing, bias: Any = None
               ) -> tuple[Any, Any, Any]:
    """Router logits [T, E] -> (ids [T, k] int, weights [T, k], margin [T]) (see `Routing`).

    `margin` is the gap between the k-th and (k+1)-th choice score (the probability, plus
    `bias` under sigmoid routing): how far the routing decision is from a tie (a
    perturbation larger than it can change the top-k).
    """
    k = routing.k
    probs = 1.0 / (1.0 + xp.exp(-logits)) if routing.sigmoid else softmax(xp, logits)  # [T, E]
    choice = probs if bias is None else probs + bias  # [T, E]
    order = xp.argsort(-choice, axis=-1, kind="stable")  # [T, E]; ties: lower index first
    ids = order[:, :k]  # [T, k]
    w = xp.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if k < logits.shape[-1]:
        top = xp.take_along_axis(choice, order[:, k - 1 : k + 1], axis=-1)  # [T, 2]
        margin = top[:, 0] - top[:, 1]
    else:
        margin = xp.ones(logits.shape[0], dtype=probs.dtype)
    if routing.norm:
        w = w / xp.sum(w, axis=-1, keepdims=True)
    if routing.scale != 1.0:
        w = w * routing.scale
    return ids, w, margin


def kv_encode(xp: ModuleType, kind: str, x: Any) -> tuple[Any, Any]:
    """x [T, H, D] float32 -> (cells, scales or None) in KV kind `kind`: f16 [T, H, D];
    int8 [T, H, D] with a float32 scale [T, H, 1] per row; q4_0 packed uint8 [T, H, D/2] with
    a float16 scale [T, H, D/32] per 32-value block."""
    if kind == "f16":
        return x.astype(xp.float16), None
    if kind == "int8":
        s = xp.max(xp.abs(x), axis=-1, keepdims=True) / 127.0  # [T, H, 1]
        s = xp.where(s == 0, 1.0, s).astype(xp.float32)
        return xp.clip(xp.rint(x / s), -127, 127).astype(xp.int8), s
    assert kind == "q4_0", kind
    t, h, d = x.shape
    blocks = x.reshape(t, h, d // Q4_BLOCK, Q4_BLOCK)  # [T, H, B, 32]
    idx = xp.argmax(xp.abs(blocks), axis=-1)[..., None]
    signed_max = xp.take_along_axis(blocks, idx, axis=-1)  # [T, H, B, 1]
    scale = (signed_max / -8.0).astype(xp.float16)
    s32 = scale.astype(xp.float32)
    inv = xp.where(s32 == 0, 0.0, 1.0 / xp.where(s32 == 0, 1.0, s32))  # no 1/0 for empty blocks
    q = xp.clip(xp.floor(blocks * inv + 8.5), 0, 15).astype(xp.uint8)  # [T, H, B, 32]
    packed = q[..., : Q4_BLOCK // 2] | (q[..., Q4_BLOCK // 2 :] << 4)  # [T, H, B, 16]
    return packed.reshape(t, h, d // 2), scale[..., 0]


def kv_decode(xp: ModuleType, kind: str, q: Any, s: Any) -> Any:
    """Cells and scales of `kv_encode` ([n, H, ..]) -> float32 [n, H, D]."""
    if kind == "f16":
        return q.astype(xp.float32)
    if kind == "int8":
        return q.astype(xp.float32) * s
    t, h, half = q.shape
    blocks = q.reshape(t, h, -1, Q4_BLOCK // 2)  # [n, H, B, 16]
    lo = (blocks & 0x0F).astype(xp.int8) - 8
    hi = (blocks >> 4).astype(xp.int8) - 8
    vals = xp.concatenate([lo, hi], axis=-1).astype(xp.float32)  # [n, H, B, 32]
    vals *= s.astype(xp.float32)[..., None]
    return vals.reshape(t, h, 2 * half)


class ArrayOps(ABC):
    """The `Backend` protocol's ops in array code on `self.xp` (see the module docstring)."""

    xp: ModuleType

    def linear(self, x: Any, w: Any) -> Any:
        """x [.., n_in] @ w [n_out, n_in]^T, float32 out (in the weight's dtype inside); a
        `QuantMatrix` is decoded first (on the host: array code keeps nothing decoded); a
        `QuantStack`, part by part."""
        if isinstance(w, QuantStack):  # one product per part, side by side
            return self.xp.concatenate([self.linear(x, p) for p in w.parts], axis=-1)
        if isinstance(w, QuantMatrix):
            w = self.xp.asarray(w.decode())
        return linear(self.xp, x, w)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """RMSNorm over the last axis of x [.., n] with weight [n]; float32 out."""
        return rms_norm(self.xp, x, weight, eps)

    def host_position(self, pos: Position) -> int:
        """A `Position` as a host int (a device one read back through `download`: array code
        computes with the host's view of it)."""
        if isinstance(pos, DevicePosition):
            return int(self.download(pos.array)[0])
        return pos

    def rope(self, x: Any, pos: Position, base: float, n_rot: int = 0) -> Any:
        """x [T, H, D] rotated (NEOX) at positions pos..pos+T-1 (the first `n_rot` dims of a
        head, 0: all); x itself may be rotated in place (callers pass a fresh array)."""
        pos0 = self.host_position(pos)
        return rope_neox(self.xp, x, self.xp.arange(pos0, pos0 + x.shape[0]), base, n_rot)

    def attention(self, q: Any, k: Any, v: Any, pos0: int) -> Any:
        """Causal grouped-query attention: q [T, H, D] at positions pos0.., k, v [S, Hkv, D]
        for positions 0..S-1 (S >= pos0 + T) -> float32 [T, H, D]."""
        return causal_gqa(self.xp, q, k, v, pos0)

    def attention_at(self, q: Any, k: Any, v: Any, cells: Any, pos: DevicePosition) -> Any:
        """The step's K/V stored into the layer's `cells` at pos.. with the KV codec, then
        `attention` over cells 0..pos+T decoded (array code reads the position back)."""
        pos0, t = self.host_position(pos), q.shape[0]
        for x, data, scale in ((k, cells.k, cells.k_scale), (v, cells.v, cells.v_scale)):
            self.kv_store(cells.kind, x, data[pos0 : pos0 + t],
                          None if scale is None else scale[pos0 : pos0 + t])
        k_all, v_all = (self.kv_load(cells.kind, data[: pos0 + t],
                                     None if scale is None else scale[: pos0 + t])
                        for data, scale in ((cells.k, cells.k_scale), (cells.v, cells.v_scale)))
        return self.attention(q, k_all, v_all, pos0)

    def route(self, logits: Any, routing: Routing, bias: Any = None) -> tuple[Any, Any, Any]:
        """Router logits [T, E] -> (ids [T, k], weights [T, k], margin [T]) (`route_topk`)."""
        return route_topk(self.xp, logits, routing, bias)

    def expert_counts(self, ids: Any, n_expert: int) -> np.ndarray:
        """Routed ids [T, k] -> host int [E]: rows per expert."""
        return np.asarray(self.download(self.xp.bincount(ids.reshape(-1), minlength=n_expert)))

    def moe(self, h: Any, ids: Any, w: Any, used: list[int], counts: np.ndarray,
            experts: ExpertProvider, layer: int) -> Any:
        """The routed FFN of one layer: h [T, d] (normed), ids / w [T, k] -> [T, d].
        `used`: the sorted experts `ids` names; `counts`: host rows per expert [E]. Here one
        expert at a time on its decoded weights (`experts.weights`)."""
        xp = self.xp
        out = xp.zeros_like(h)
        for e in used:
            tok, slot = xp.nonzero(ids == e)  # each token routes to an expert at most once
            gate, up, down = experts.weights(layer, e)
            he = h[tok]  # [n_e, d]
            act = silu(xp, self.linear(he, gate)) * self.linear(he, up)  # [n_e, f]
            out[tok] += self.linear(act, down) * w[tok, slot][:, None]  # [n_e, d]
        return out

    def moe_at(self, h: Any, ids: Any, w: Any, source: Any) -> Any:
        """No array code finds experts itself: only the CUDA token graph's provider hands out
        a `source`, and the sim never builds one."""
        raise AssertionError("moe_at: an expert source reached the array ops (a CUDA provider "
                             "on a non-CUDA backend)")

    def kv_store(self, kind: str, x: Any, cells: Any, scales: Any) -> None:
        """Encode x [T, Hkv, D] float32 into KV cells [T, Hkv, ..] and their scales (None for
        f16) of kind `kind` (`kv_encode`)."""
        q, s = kv_encode(self.xp, kind, x)
        cells[...] = q
        if s is not None:
            scales[...] = s

    def kv_load(self, kind: str, cells: Any, scales: Any, chunk: bool = False) -> Any:
        """KV cells [n, Hkv, ..] and scales of kind `kind` -> float32 [n, Hkv, D] (a prompt
        chunk's too: array code computes in float32)."""
        return kv_decode(self.xp, kind, cells, scales)

    def embed(self, rows: np.ndarray, qtype: GGMLQuantizationType, n_embd: int) -> DeviceArray:
        """Quantized embedding rows in host memory, uint8 [T, row_bytes] -> float32 [T, d] on
        the device (decoded on the host here, then one counted upload)."""
        return self.to_device(dequantize_bytes(rows, qtype, (len(rows), n_embd)))

    @abstractmethod
    def to_device(self, host: np.ndarray) -> DeviceArray:
        """A new device array holding a copy of `host` (the backend's counted upload)."""

    @abstractmethod
    def download(self, dev: DeviceArray) -> np.ndarray:
        """A host copy of a device array."""
