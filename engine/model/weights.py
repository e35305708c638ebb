"""Model weights: dense tensors decoded once, experts kept as quantized blobs in host memory.

An expert blob is the raw bytes of one (layer, expert): gate | up | down rows, exactly as the
GGUF stores them, so it can be copied into a cache slot or a staging-ring slot unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf import names
from engine.gguf.hparams import HParams
from engine.gguf.reader import ModelFile, TensorView
from engine.model.attention import AttentionWeights
from engine.quant import ExpertLayout, dequantize, dequantize_bytes, row_bytes


@dataclass
class BlockWeights:
    attn: AttentionWeights
    ffn_norm: Any  # [d]
    router: Any  # [E, d]


class HostExperts:
    """The routed experts of a set of blocks, read from the memory-mapped GGUF (zero-copy)."""

    def __init__(self, mf: ModelFile, blocks: range):
        self.blocks = blocks
        first = blocks[0]
        parts = [mf.tensor(names.block(k, first)) for k in names.EXPERT_TENSORS]
        self.layout = ExpertLayout(
            qtypes=tuple(t.qtype for t in parts),  # type: ignore[arg-type]
            shapes=tuple(t.shape[1:] for t in parts),  # type: ignore[arg-type]
        )
        self._parts: list[list[np.ndarray]] = []  # [layer][part] uint8 [E, part_bytes]
        for i in blocks:
            tensors = [mf.tensor(names.block(k, i)) for k in names.EXPERT_TENSORS]
            for t, q in zip(tensors, self.layout.qtypes):
                assert t.qtype == q, f"{t.name}: mixed quant types across layers are not supported"
            self._parts.append([_rows(t) for t in tensors])
        self.n_layer = len(blocks)
        self.n_expert = parts[0].shape[0]
        self.blob_bytes = self.layout.blob_bytes

    def pieces(self, layer: int, expert: int) -> list[np.ndarray]:
        """[gate, up, down] uint8 views into the file: the blob without a host copy (an
        upload of the list is one DMA per piece where the file is pinned)."""
        return [p[expert] for p in self._parts[layer]]

    def parts(self, layer: int) -> list[np.ndarray]:
        """The layer's gate, up and down expert tensors: uint8 [E, part bytes] views into the
        file (the token graph reads a missed expert from them in place, over PCIe)."""
        return list(self._parts[layer])

    def blob(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [blob_bytes]: gate | up | down of `expert` in local layer index `layer`."""
        return np.concatenate(self.pieces(layer, expert))

    def weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.layout.decode(self.blob(layer, expert))


def _rows(t: TensorView) -> np.ndarray:
    """A [E, ...] expert tensor as uint8 [E, bytes per expert] (zero-copy view)."""
    return t.raw.reshape(t.shape[0], -1).view(np.uint8)


class DecodedLRU:
    """Decoded (float32) expert weights keyed by an identity, bounded in bytes.

    The CPU stands in for a GPU's fused dequantize-GEMV kernels; keeping recently decoded
    experts avoids re-decoding the same blob every token. Keys must change whenever the
    underlying bytes do (the cache-backed provider keys by slot and fill generation).
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._items: OrderedDict[Any, tuple[Any, Any, Any]] = OrderedDict()
        self._bytes = 0

    def get(self, key: Any, make: Callable[[], tuple[Any, Any, Any]]) -> tuple[Any, Any, Any]:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        value = make()
        self._items[key] = value
        self._bytes += sum(int(w.nbytes) for w in value)
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._bytes -= sum(int(w.nbytes) for w in old)
        return value

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0


class DirectExperts:
    """ExpertProvider that decodes experts straight from host memory (no cache, no ring)."""

    def __init__(self, host: HostExperts, to_device: Any = np.asarray, max_bytes: int = 256 << 20):
        self.host = host
        self._to_device = to_device
        self._decoded = DecodedLRU(max_bytes)

    def prepare(self, layer: int, experts: list[int]) -> None:
        pass

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        return self._decoded.get(
            (layer, expert),
            lambda: tuple(self._to_device(w) for w in self.host.weights(layer, expert)),  # type: ignore[return-value]
        )


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
