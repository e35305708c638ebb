"""The qwen3moe transformer: embed -> blocks (attention + MoE) -> final norm -> output head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf import names
from engine.gguf.hparams import HParams
from engine.gguf.reader import ModelFile
from engine.kv import KVCache
from engine.model.attention import attention_block
from engine.model.moe import ExpertProvider, moe_block
from engine.model.ops import rms_norm
from engine.model.weights import BlockWeights, TokenEmbedding, load_block
from engine.quant import dequantize


@dataclass
class ForwardResult:
    logits: Any  # [T_out, V] float32 (T_out = 1 for 'last', T for 'all', 0 for 'none')
    hidden: Any  # [T, d] residual stream before the final norm (the MTP block's input)
    routes: list[Any]  # per layer ids [T, k], for profiling
    margins: Any  # [T] smallest top-k routing margin over the layers (distance to a tie)


class Transformer:
    """Main blocks of the model. Weights are read-only; run-state lives in the KV cache."""

    def __init__(self, mf: ModelFile, hp: HParams, xp: Any, to_device: Any):
        self.hp, self.xp = hp, xp
        self.embd = TokenEmbedding(mf.tensor(names.TOKEN_EMBD))
        self._to_device = to_device
        self.blocks: list[BlockWeights] = [load_block(mf, i, to_device) for i in range(hp.n_layer)]
        self.output_norm = to_device(dequantize(mf.tensor(names.OUTPUT_NORM)))
        out = mf.tensors.get(names.OUTPUT)
        # [V, d] native output head; the tied case reuses the embedding table
        self.head_host = dequantize(out) if out is not None else self.embd.full()
        self.head: Any = to_device(self.head_host)

    def embed(self, tokens: np.ndarray) -> Any:
        """tokens: [T] -> [T, d]."""
        return self._to_device(self.embd.rows(np.asarray(tokens, dtype=np.int64)))

    def forward(
        self,
        tokens: np.ndarray,
        pos0: int,
        kv: KVCache,
        experts: ExpertProvider,
        logits: str = "last",
    ) -> ForwardResult:
        """Run tokens [T] at positions pos0..pos0+T-1, appending their K/V to `kv`."""
        xp, hp = self.xp, self.hp
        x = self.embed(tokens)  # [T, d]
        routes = []
        margins = xp.full(len(tokens), xp.inf, dtype=xp.float32)
        for i, blk in enumerate(self.blocks):
            x = x + attention_block(xp, hp, blk.attn, x, pos0, kv, i)
            ffn, ids, margin = moe_block(xp, hp, blk.ffn_norm, blk.router, x, i, experts)
            x = x + ffn
            routes.append(ids)
            margins = xp.minimum(margins, margin)
        kv.n_tokens = pos0 + len(tokens)
        if logits == "none":
            out = xp.zeros((0, hp.n_vocab), dtype=xp.float32)
        else:
            out = self.logits(x if logits == "all" else x[-1:])
        return ForwardResult(logits=out, hidden=x, routes=routes, margins=margins)

    def logits(self, hidden: Any) -> Any:
        """hidden: [T, d] pre-norm -> [T, V] with the native output head."""
        assert self.head is not None, "output head is released (on loan); restore it first"
        return rms_norm(self.xp, hidden, self.output_norm, self.hp.rms_eps) @ self.head.T
