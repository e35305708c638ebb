"""Host-side expert bytes: where the cache fills and refills its slots from.

An expert blob is the raw bytes of one (layer, expert): gate | up | down rows, exactly as the
GGUF stores them, so it can be copied into a cache slot or a staging-ring slot unchanged.
`FileExperts` reads them from the memory-mapped model file; `ArrayHostExperts` from one array.

Layers may store their experts in different quant types (llama.cpp's quantizer gives
`ffn_down_exps` more bits on some layers: Q4_K_M puts Q6_K on about half of them), so each
layer has its own `ExpertLayout` and blob size. Every cache and ring slot is as large as the
largest blob (`blob_bytes`); a smaller blob fills the front of its slot and the rest is unused
(`ExpertCache.slack_bytes`; docs/quant-mixes.md measures it against a slot size per layout).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from engine.gguf import names
from engine.gguf.quant import ExpertLayout
from engine.gguf.reader import ModelFile, TensorView


@runtime_checkable
class HostExperts(Protocol):
    """Every routed expert's quantized bytes in host memory, one blob per (layer, expert).

    A blob is the expert's gate, up and down weights as raw quantized bytes, concatenated in
    that order; the blobs of one layer have one size (`layer_blob_bytes`), and `blob_bytes`
    is the largest of them: the size of a slot that can hold any blob.
    """

    n_layer: int
    n_expert: int
    blob_bytes: int
    layer_blob_bytes: tuple[int, ...]  # [n_layer]

    def blob(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [layer_blob_bytes[layer]] of (layer, expert)."""
        ...

    def pieces(self, layer: int, expert: int) -> list[np.ndarray]:
        """The blob as uint8 pieces that concatenate to it, without a host copy (what the
        device uploads: one DMA per piece where the memory is pinned)."""
        ...


class ArrayHostExperts:
    """`HostExperts` over one uint8 array [n_layer, n_expert, blob_bytes]; `layer_bytes`:
    each layer's blob size (the first bytes of each row; default: every row whole)."""

    def __init__(self, blobs: np.ndarray, layer_bytes: tuple[int, ...] | None = None):
        assert blobs.dtype == np.uint8 and blobs.ndim == 3, (blobs.dtype, blobs.shape)
        self.blobs = blobs  # [L, E, B]
        self.n_layer, self.n_expert, width = blobs.shape
        self.layer_blob_bytes = tuple(layer_bytes or (width,) * self.n_layer)
        assert len(self.layer_blob_bytes) == self.n_layer and max(self.layer_blob_bytes) <= width
        self.blob_bytes = max(self.layer_blob_bytes)

    def blob(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [layer_blob_bytes[layer]] of (layer, expert)."""
        return self.blobs[layer, expert, : self.layer_blob_bytes[layer]]

    def pieces(self, layer: int, expert: int) -> list[np.ndarray]:
        return [self.blob(layer, expert)]


class FileExperts:
    """`HostExperts` of a set of blocks, read from the memory-mapped GGUF (zero-copy), with
    each block's `ExpertLayout` (`layouts`, in local layer order)."""

    def __init__(self, mf: ModelFile, blocks: range):
        self.blocks = blocks
        self._parts: list[list[np.ndarray]] = []  # [layer][part] uint8 [E, part_bytes]
        layouts = []
        for i in blocks:
            tensors = [mf.tensor(names.block(k, i)) for k in names.EXPERT_TENSORS]
            layouts.append(ExpertLayout(
                qtypes=tuple(t.qtype for t in tensors),  # type: ignore[arg-type]
                shapes=tuple(t.shape[1:] for t in tensors),  # type: ignore[arg-type]
            ))
            self._parts.append([_rows(t) for t in tensors])
        self.layouts: tuple[ExpertLayout, ...] = tuple(layouts)
        self.n_layer = len(blocks)
        self.n_expert = self._parts[0][0].shape[0]
        self.layer_blob_bytes = tuple(lay.blob_bytes for lay in self.layouts)
        self.blob_bytes = max(self.layer_blob_bytes)

    def layout_of(self, layer: int) -> ExpertLayout:
        """The byte layout of local layer `layer`'s blobs."""
        return self.layouts[layer]

    def pieces(self, layer: int, expert: int) -> list[np.ndarray]:
        """[gate, up, down] uint8 views into the file: the blob without a host copy (an
        upload of the list is one DMA per piece where the file is pinned)."""
        return [p[expert] for p in self._parts[layer]]

    def parts(self, layer: int) -> list[np.ndarray]:
        """The layer's gate, up and down expert tensors: uint8 [E, part bytes] views into the
        file (the token graph reads a missed expert from them in place, over PCIe)."""
        return list(self._parts[layer])

    def blob(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [layer_blob_bytes[layer]]: gate | up | down of `expert` in local layer
        index `layer`."""
        return np.concatenate(self.pieces(layer, expert))

    def weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.layouts[layer].decode(self.blob(layer, expert))


def _rows(t: TensorView) -> np.ndarray:
    """A [E, ...] expert tensor as uint8 [E, bytes per expert] (zero-copy view)."""
    return t.raw.reshape(t.shape[0], -1).view(np.uint8)
