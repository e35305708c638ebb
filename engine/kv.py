"""KV cache stored as f16, int8 (per-row scale) or q4_0 (32-element blocks), one per layer.

Rows are (cell, kv-head); `truncate(n)` drops rejected speculative tokens. The codecs are the
backend's (`kv_store`, `kv_load`: engine/backend/array_ops.py, a fused kernel for q4_0 on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.backend.array_ops import KV_KINDS, Q4_BLOCK
from engine.backend.base import Backend, DevicePosition, KVCells, Position
from engine.errors import FlagError


def kv_bytes_per_cell(kind: str, n_layer: int, kv_dim: int, n_head_kv: int) -> int:
    """Bytes one token costs across all layers, K and V together."""
    per_row = {"f16": 2 * kv_dim, "int8": kv_dim, "q4_0": kv_dim // 2}[kind]
    scales = {"f16": 0, "int8": 4 * n_head_kv, "q4_0": 2 * (kv_dim // Q4_BLOCK)}[kind]
    return 2 * n_layer * (per_row + scales)


class KVCache:
    """Keys and values for `n_ctx` cells of `n_layer` layers.

    `alloc(shape, dtype)` provides the storage (ledger-backed views on a device); by default
    plain `xp.zeros`. `n_tokens` is the committed length shared by all layers.
    """

    def __init__(
        self,
        backend: Backend,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        kind: str = "f16",
        alloc: Callable[[tuple[int, ...], Any], Any] | None = None,
    ):
        assert kind in KV_KINDS, kind
        if kind == "q4_0" and head_dim % Q4_BLOCK:
            raise FlagError(
                f"--kv q4_0 needs a head size that is a multiple of {Q4_BLOCK}; this model's is "
                f"{head_dim}: use --kv int8 or f16"
            )
        xp = backend.xp
        self.backend, self.xp, self.kind = backend, xp, kind
        self.n_layer, self.n_ctx, self.n_head_kv, self.head_dim = n_layer, n_ctx, n_head_kv, head_dim
        self.n_tokens = 0
        alloc = alloc or (lambda shape, dtype: xp.zeros(shape, dtype=dtype))
        shape = (n_layer, 2, n_ctx, n_head_kv)  # layer, K/V, cell, head
        if kind == "f16":
            self.data = alloc((*shape, head_dim), xp.float16)
            self.scale = None
        elif kind == "int8":
            self.data = alloc((*shape, head_dim), xp.int8)
            self.scale = alloc((*shape, 1), xp.float32)
        else:
            self.data = alloc((*shape, head_dim // 2), xp.uint8)
            self.scale = alloc((*shape, head_dim // Q4_BLOCK), xp.float16)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0))

    def write(self, layer: int, pos0: int, k: Any, v: Any) -> None:
        """Store k, v: [T, n_head_kv, head_dim] at cells pos0..pos0+T-1."""
        t = k.shape[0]
        assert pos0 + t <= self.n_ctx, f"KV overflow: {pos0 + t} cells > n_ctx {self.n_ctx}"
        for j, x in enumerate((k, v)):
            scales = self.scale[layer, j, pos0 : pos0 + t] if self.scale is not None else None
            self.backend.kv_store(self.kind, x, self.data[layer, j, pos0 : pos0 + t], scales)

    def read(self, layer: int, n: int, chunk: bool = False) -> tuple[Any, Any]:
        """K, V of cells 0..n-1 as float32 [n, n_head_kv, head_dim]; for a prompt chunk's
        attention (`chunk`) in the dtype the backend's kernel reads (`Backend.kv_load`)."""
        return self._load(layer, 0, n, chunk), self._load(layer, 1, n, chunk)

    def attend(self, layer: int, pos: Position, q: Any, k: Any, v: Any) -> Any:
        """Store k, v [T, Hkv, D] at cells pos.. of `layer` and attend q [T, H, D] (normed,
        rotated) causally over cells 0..pos+T-1 -> float32 [T, H, D]. A device position (a
        captured decode step) reads and writes the cells in place (`Backend.attention_at`)."""
        if isinstance(pos, DevicePosition):
            return self.backend.attention_at(q, k, v, self.cells(layer), pos)
        t = q.shape[0]
        self.write(layer, pos, k, v)
        k_all, v_all = self.read(layer, pos + t, chunk=t > 1)  # [S, Hkv, D] with S = pos + T
        return self.backend.attention(q, k_all, v_all, pos)

    def cells(self, layer: int) -> KVCells:
        """Every cell of `layer`, K and V with their scales, as views (no copy)."""
        scale = self.scale
        return KVCells(self.kind, self.data[layer, 0], None if scale is None else scale[layer, 0],
                       self.data[layer, 1], None if scale is None else scale[layer, 1])

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.n_tokens, (n, self.n_tokens)
        self.n_tokens = n

    def check_integrity(self) -> None:
        assert 0 <= self.n_tokens <= self.n_ctx, f"KV n_tokens {self.n_tokens} outside 0..{self.n_ctx}"

    def _load(self, layer: int, j: int, n: int, chunk: bool = False) -> Any:
        scales = self.scale[layer, j, :n] if self.scale is not None else None
        return self.backend.kv_load(self.kind, self.data[layer, j, :n], scales, chunk)
