"""The transformer of qwen3moe and glm4moe: embed -> blocks (attention + MoE, or a dense FFN
in glm4moe's leading blocks) -> final norm -> output head."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend.base import Backend, DevicePosition, ExpertProvider, Position
from engine.gguf import names
from engine.gguf.hparams import HParams
from engine.gguf.quant import dequantize
from engine.gguf.reader import ModelFile
from engine.kv import KVCache
from engine.memory.compute_arena import ArenaStats
from engine.model.attention import attention_block
from engine.model.moe import dense_block, moe_block
from engine.model.weights import BlockWeights, TokenEmbedding, WeightLoader, load_block
from engine.trace import phases
from engine.trace.phases import PhaseClock


@dataclass
class PromptChunk:
    """What the prompt path lends one forward pass of a prompt chunk (a per-call context):
    `buf`, uint8 device bytes holding the residual stream [T, d] float32 and then the chunk's
    temporaries (a chunk arena on CUDA); the prompt's phase clock (STRATA_TRACE); and
    `arena`, what the temporaries took, merged over the chunks that share this record."""

    buf: Any
    clock: PhaseClock | None = None
    arena: ArenaStats | None = None


@dataclass
class ForwardResult:
    logits: Any  # [T_out, V] float32 (T_out = 1 for 'last', T for 'all', 0 for 'none')
    hidden: Any  # [T, d] residual stream before the final norm (the MTP block's input)
    routes: Any  # per layer ids [T, k]: a list, or one [L, T, k] array (the token graph's)
    margins: Any  # [T] smallest top-k routing margin over the layers (distance to a tie)


class Transformer:
    """Main blocks of the model. Weights are read-only; run-state lives in the KV cache and
    in what a call is given (a prompt chunk's `PromptChunk`)."""

    def __init__(
        self, mf: ModelFile, hp: HParams, backend: Backend, to_device: Any,
        head_to_device: Any = None, quantized: bool = False,
    ):
        """`to_device` / `head_to_device`: where the dense weights and the head go (ledger
        regions' arenas); `quantized`: linear weights stay in their blocks (`--dense quant`)."""
        self.hp, self.backend, self.xp, self.mf = hp, backend, backend.xp, mf
        self.quantized = quantized
        self.embd = TokenEmbedding(mf.tensor(names.TOKEN_EMBD))  # stays in host memory
        load = WeightLoader(to_device, quantized)
        self.blocks: list[BlockWeights] = [load_block(mf, hp, i, load) for i in range(hp.n_layer)]
        self.output_norm = load.vector(mf.tensor(names.OUTPUT_NORM))
        self.head: Any = None  # [V, d] the output head (array or QuantMatrix); `load_head`
        self._head_host: np.ndarray | None = None
        self.load_head(head_to_device or to_device)

    def head_host(self) -> np.ndarray:
        """[V, d] float32 output head from the file (tied models reuse the embedding table),
        decoded once and kept in host memory so a loan's restore is one upload."""
        if self._head_host is None:
            self._head_host = dequantize(self.head_tensor())
        return self._head_host

    def head_tensor(self) -> Any:
        """The file's output head tensor (tied models: the token embedding's)."""
        return self.mf.tensor(names.native_head(self.hp.has_output))

    def load_head(self, to_device: Any) -> None:
        """Upload the head: in its quantized blocks straight from the (page-locked) file map
        when quantized, else the decoded host copy (`head_host`)."""
        load, t = WeightLoader(to_device, self.quantized), self.head_tensor()
        self.head = load.matrix(t) if load.keeps(t) else to_device(self.head_host())

    def release_head(self) -> None:
        self.head = None

    def embed(self, tokens: np.ndarray) -> Any:
        """tokens: [T] -> [T, d] float32 on the device (activations, not weights: never in a
        weight region); the backend decodes the quantized rows (`Backend.embed`)."""
        ids = np.asarray(tokens, dtype=np.int64)
        return self.backend.embed(self.embd.raw_rows(ids), self.embd.t.qtype, self.hp.n_embd)

    def forward(
        self,
        tokens: np.ndarray,
        pos: Position,
        kv: KVCache,
        experts: ExpertProvider,
        logits: str = "last",
        chunk: PromptChunk | None = None,
    ) -> ForwardResult:
        """Run tokens [T] at positions pos..pos+T-1, appending their K/V to `kv`.

        `chunk` (optional): the prompt path's chunk buffer, carved from lent cache slots, which
        holds the residual stream and the temporaries, with the prompt's clock and stats.
        """
        return self.forward_embedded(self.embed(tokens), pos, kv, experts, logits, chunk)

    def forward_embedded(
        self,
        x: Any,
        pos: Position,
        kv: KVCache,
        experts: ExpertProvider,
        logits: str = "last",
        chunk: PromptChunk | None = None,
    ) -> ForwardResult:
        """`forward` from embedded rows x [T, d] float32 (added to in place: the residual
        stream). The token graph captures this with `pos` on the device and an expert provider
        whose kernels read the routing there (`SourcedExperts`): the same pass, replayed."""
        be, xp, hp = self.backend, self.xp, self.hp
        n_rows = x.shape[0]
        arena = None
        if chunk is not None:
            n = x.nbytes
            stream = chunk.buf[:n].view(xp.float32).reshape(x.shape)  # [T, d] in the chunk buffer
            stream[...] = x
            x = stream
            arena = be.chunk_arena(chunk.buf[-(-n // 4096) * 4096 :])  # the rest: temporaries
        routes = []
        margins = xp.full(n_rows, xp.inf, dtype=xp.float32)
        experts.prefetch(0)
        clock = chunk.clock if chunk is not None else None
        lap = clock.lap if clock is not None else (lambda phase: None)
        lap("embed+setup")  # since the previous chunk's last layer (or the prompt's start)
        with arena or nullcontext(), phases.active(clock):
            for i, blk in enumerate(self.blocks):
                layer = hp.moe_index(i)  # the expert provider's layer
                if layer >= 0:  # the next layer's experts upload while this one computes
                    experts.prefetch(layer + 1)
                x += attention_block(be, hp, blk.attn, x, pos, kv, i)
                lap("attention")
                if layer < 0:  # a dense leading block
                    x += dense_block(be, hp, blk, x)
                    lap("moe")
                    continue
                ffn, ids, margin = moe_block(be, hp, blk, x, layer, experts)
                x += ffn
                lap("moe")
                routes.append(ids)
                margins = xp.minimum(margins, margin)
                del ffn, ids, margin
        if arena is not None:  # keep nothing in the lent chunk buffer past this call
            assert chunk is not None
            routes, margins = [r.copy() for r in routes], margins.copy()
            arena.close()
            chunk.arena = ArenaStats.of(arena).merge(chunk.arena)
        if not isinstance(pos, DevicePosition):  # a replayed step's caller knows its position
            kv.n_tokens = pos + n_rows
        if logits == "none":
            out = xp.zeros((0, hp.n_vocab), dtype=xp.float32)
        else:
            out = self.logits(x if logits == "all" else x[-1:])
        hidden = x.copy() if chunk is not None else x  # the chunk buffer is lent memory
        return ForwardResult(logits=out, hidden=hidden, routes=routes, margins=margins)

    def logits(self, hidden: Any) -> Any:
        """hidden: [T, d] pre-norm -> [T, V] with the native output head."""
        assert self.head is not None, "output head is released (on loan); restore it first"
        be = self.backend
        return be.linear(be.rms_norm(hidden, self.output_norm, self.hp.rms_eps), self.head)
