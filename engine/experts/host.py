"""Host-side expert bytes: where the cache fills and refills its slots from.

An expert blob is the raw bytes of one (layer, expert): gate | up | down rows, exactly as the
GGUF stores them, so it can be copied into a cache slot or a staging-ring slot unchanged.
`FileExperts` reads them from the memory-mapped model file; `ArrayHostExperts` from one array.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from engine.gguf import names
from engine.gguf.reader import ModelFile, TensorView
from engine.quant import ExpertLayout


@runtime_checkable
class HostExperts(Protocol):
    """Every routed expert's quantized bytes in host memory, one blob per (layer, expert).

    A blob is the expert's gate, up and down weights as raw quantized bytes, concatenated in
    that order; every blob of a model has the same size.
    """

    n_layer: int
    n_expert: int
    blob_bytes: int

    def blob(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [blob_bytes] of (layer, expert)."""
        ...

    def pieces(self, layer: int, expert: int) -> list[np.ndarray]:
        """The blob as uint8 pieces that concatenate to it, without a host copy (what the
        device uploads: one DMA per piece where the memory is pinned)."""
        ...


class ArrayHostExperts:
    """`HostExperts` over one uint8 array [n_layer, n_expert, blob_bytes]."""

    def __init__(self, blobs: np.ndarray):
        assert blobs.dtype == np.uint8 and blobs.ndim == 3, (blobs.dtype, blobs.shape)
        self.blobs = blobs  # [L, E, B]
        self.n_layer, self.n_expert, self.blob_bytes = blobs.shape

    def blob(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [blob_bytes] of (layer, expert)."""
        return self.blobs[layer, expert]

    def pieces(self, layer: int, expert: int) -> list[np.ndarray]:
        return [self.blobs[layer, expert]]


class FileExperts:
    """`HostExperts` of a set of blocks, read from the memory-mapped GGUF (zero-copy), with
    their `ExpertLayout`."""

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
