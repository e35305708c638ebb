"""Model weights: dense tensors put on the device once (the linear weights in their quantized
blocks with `--dense quant`, else decoded), the token embedding decoded on demand from host
memory. The routed experts stay quantized in the memory-mapped file (engine/experts/host.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf import names
from engine.gguf.hparams import HParams
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


@dataclass
class BlockWeights:
    attn: AttentionWeights
    ffn_norm: Any  # [d]
    router: Any  # [E, d]


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


def load_attention(mf: ModelFile, i: int, load: WeightLoader) -> AttentionWeights:
    get = lambda kind: mf.tensor(names.block(kind, i))
    return AttentionWeights(
        norm=load.vector(get("attn_norm")),
        wqkv=load.matrix(get("attn_q"), get("attn_k"), get("attn_v")),
        wo=load.matrix(get("attn_output")),
        q_norm=load.vector(get("attn_q_norm")),
        k_norm=load.vector(get("attn_k_norm")),
    )


def load_block(mf: ModelFile, i: int, load: WeightLoader) -> BlockWeights:
    return BlockWeights(
        attn=load_attention(mf, i, load),
        ffn_norm=load.vector(mf.tensor(names.block("ffn_norm", i))),
        router=load.vector(mf.tensor(names.block("ffn_gate_inp", i))),
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
    """Bytes of the always-resident dense weights of the main blocks (quantized sizes)."""
    total = mf.tensor(names.TOKEN_EMBD).n_bytes + mf.tensor(names.OUTPUT_NORM).n_bytes
    for i in range(hp.n_layer):
        for kind in names.BLOCK:
            if kind not in names.EXPERT_TENSORS:
                total += mf.tensor(names.block(kind, i)).n_bytes
    return total
