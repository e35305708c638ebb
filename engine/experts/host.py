"""Host-side expert bytes: where the cache fills and refills its slots from."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


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
