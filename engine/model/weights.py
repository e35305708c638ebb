"""Model weights: dense tensors decoded once onto the device, the token embedding decoded on
demand from host memory. The routed experts stay quantized in the memory-mapped file
(engine/experts/host.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf import names
from engine.gguf.hparams import HParams
from engine.gguf.reader import ModelFile, TensorView
from engine.model.attention import AttentionWeights
from engine.quant import dequantize, dequantize_bytes, row_bytes


@dataclass
class BlockWeights:
    attn: AttentionWeights
    ffn_norm: Any  # [d]
    router: Any  # [E, d]


def load_attention(mf: ModelFile, i: int, dev: Any) -> AttentionWeights:
    get = lambda kind: dev(dequantize(mf.tensor(names.block(kind, i))))
    return AttentionWeights(
        norm=get("attn_norm"),
        wq=get("attn_q"),
        wk=get("attn_k"),
        wv=get("attn_v"),
        wo=get("attn_output"),
        q_norm=get("attn_q_norm"),
        k_norm=get("attn_k_norm"),
    )


def load_block(mf: ModelFile, i: int, dev: Any) -> BlockWeights:
    return BlockWeights(
        attn=load_attention(mf, i, dev),
        ffn_norm=dev(dequantize(mf.tensor(names.block("ffn_norm", i)))),
        router=dev(dequantize(mf.tensor(names.block("ffn_gate_inp", i)))),
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
