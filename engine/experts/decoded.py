"""Decoded expert weights kept in memory, bounded in bytes (the array path's stand-in for the
GPU's dequantizing kernels)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


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
