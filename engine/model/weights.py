"""Model weights: dense tensors put on the device once (the linear weights in their quantized
blocks with `--dense quant`, else decoded), the token embedding decoded on demand from host
memory. The routed experts stay quantized in the memory-mapped file (engine/experts/host.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf import names
from engine.gguf.hparams import HParams, block_shapes
from engine.gguf.quant import (
    QuantMatrix,
    QuantStack,
    dequantize,
    dequantize_bytes,
    keeps_quantized,
    row_bytes,
)
from engine.gguf.reader import ModelFile, TensorView
from engine.model.attention import AttentionWeights
from engine.model.moe import DenseFFN


@dataclass
class BlockWeights:
    """One block's resident weights: attention, the FFN's norm, and either a router (with
    glm4moe's selection bias and shared expert) or a dense FFN."""

    attn: AttentionWeights
    ffn_norm: Any  # [d]
    router: Any  # [E, d], or None (a dense block)
    selection_bias: Any = None  # [E] (sigmoid routing), or None
    shared: DenseFFN | None = None  # the shared expert, or None
    dense: DenseFFN | None = None  # a dense block's FFN (router None)


@dataclass(frozen=True)
class WeightLoader:
    """Puts a model file's dense tensors on the device: `to_device` uploads a host array (a
    ledger region's arena); with `quantized`, a linear weight whose type the kernels decode
    stays in its blocks (a `QuantMatrix`), else it is decoded (to the arena's float type)."""

    to_device: Any
    quantized: bool = False

    def vector(self, t: TensorView) -> Any:
        return self.to_device(dequantize(t))

    def keeps(self, *ts: TensorView) -> bool:
        """Whether `matrix(*ts)` keeps their blocks: quantized, types the kernels decode."""
        return self.quantized and all(keeps_quantized(t.qtype) for t in ts)

    def matrix(self, *ts: TensorView) -> Any:
        """One weight [sum of rows, n_in] from tensors stacked by rows (q, k and v: one
        projection, one launch; a `QuantStack` of one part per tensor where their kept types
        differ)."""
        q = ts[0].qtype
        if self.keeps(*ts):
            if any(t.qtype != q for t in ts):  # a quant mix: a part per type
                return QuantStack(tuple(self.matrix(t) for t in ts))
            parts = [np.ascontiguousarray(t.raw).reshape(-1).view(np.uint8) for t in ts]
            raw = parts[0] if len(parts) == 1 else np.concatenate(parts)  # one: the file map
            shape = (sum(t.shape[0] for t in ts), ts[0].shape[1])
            return QuantMatrix(self.to_device(raw), q, shape)
        return self.to_device(np.concatenate([dequantize(t) for t in ts]) if len(ts) > 1 else dequantize(ts[0]))


def load_attention(mf: ModelFile, hp: HParams, i: int, load: WeightLoader) -> AttentionWeights:
    get = lambda kind: mf.tensor(names.block(kind, i))
    bias = None
    if hp.qkv_bias:  # q, k and v biases stacked like the weight
        bias = load.to_device(np.concatenate([dequantize(get(f"attn_{x}_bias")) for x in "qkv"]))
    return AttentionWeights(
        norm=load.vector(get("attn_norm")),
        wqkv=load.matrix(get("attn_q"), get("attn_k"), get("attn_v")),
        wo=load.matrix(get("attn_output")),
        q_norm=load.vector(get("attn_q_norm")) if hp.qk_norm else None,
        k_norm=load.vector(get("attn_k_norm")) if hp.qk_norm else None,
        bias=bias,
    )


def load_ffn(mf: ModelFile, i: int, load: WeightLoader, suffix: str) -> DenseFFN:
    """A SwiGLU FFN's weights: `ffn_gate{suffix}` and `ffn_up{suffix}` stacked, `ffn_down{suffix}`."""
    get = lambda kind: mf.tensor(names.block(kind + suffix, i))
    gate = get("ffn_gate")
    return DenseFFN(gate_up=load.matrix(gate, get("ffn_up")), down=load.matrix(get("ffn_down")),
                    n_ff=gate.shape[0])


def load_block(mf: ModelFile, hp: HParams, i: int, load: WeightLoader) -> BlockWeights:
    attn, norm = load_attention(mf, hp, i, load), load.vector(mf.tensor(names.block(hp.ffn_norm, i)))
    if not hp.is_moe(i):
        return BlockWeights(attn, norm, router=None, dense=load_ffn(mf, i, load, ""))
    return BlockWeights(
        attn, norm,
        router=load.vector(mf.tensor(names.block("ffn_gate_inp", i))),
        selection_bias=load.vector(mf.tensor(names.block("exp_probs_b", i))) if hp.selection_bias else None,
        shared=load_ffn(mf, i, load, "_shexp") if hp.n_expert_shared else None,
    )


class TokenEmbedding:
    """Token embedding rows decoded on demand from the quantized table (get_rows)."""

    def __init__(self, t: TensorView):
        self.t = t
        self.n_vocab, self.n_embd = t.shape
        self._row_bytes = row_bytes(t.qtype, self.n_embd)
        self._rows = t.raw.reshape(self.n_vocab, -1).view(np.uint8)  # [V, row_bytes]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """ids: [T] -> float32 [T, d]."""
        return dequantize_bytes(self._rows[ids], self.t.qtype, (len(ids), self.n_embd))

    def raw_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids: [T] -> their quantized rows, uint8 [T, row_bytes] (for decoding elsewhere)."""
        return self._rows[ids]

    def full(self) -> np.ndarray:
        return dequantize(self.t)


def dense_bytes(mf: ModelFile, hp: HParams) -> int:
    """Bytes of the always-resident dense weights of the main blocks (quantized sizes): the
    embedding, the final norm, and every block tensor but the routed experts (a shared expert
    and a dense block's FFN are resident)."""
    total = mf.tensor(names.TOKEN_EMBD).n_bytes + mf.tensor(names.OUTPUT_NORM).n_bytes
    for i in range(hp.n_layer):
        for kind in block_shapes(hp, i):
            if kind not in names.EXPERT_TENSORS:
                total += mf.tensor(names.block(kind, i)).n_bytes
    return total
