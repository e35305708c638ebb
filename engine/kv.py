"""KV cache stored as f16, int8 (per-row scale) or q4_0 (32-element blocks), one per layer.

Rows are (cell, kv-head); `truncate(n)` drops rejected speculative tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.errors import FlagError

KV_KINDS = ("f16", "int8", "q4_0")
Q4_BLOCK = 32


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
        xp: Any,
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
        self.xp, self.kind = xp, kind
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
        fused = self.kind == "q4_0" and self.xp.__name__ == "cupy"
        for j, x in enumerate((k, v)):
            if fused:  # encode straight into the cells: one launch
                from engine.kernels.fused import kv_q4_encode

                kv_q4_encode(x, self.data[layer, j, pos0 : pos0 + t], self.scale[layer, j, pos0 : pos0 + t])
                continue
            q, s = self._encode(x)
            self.data[layer, j, pos0 : pos0 + t] = q
            if s is not None:
                self.scale[layer, j, pos0 : pos0 + t] = s

    def read(self, layer: int, n: int) -> tuple[Any, Any]:
        """K, V of cells 0..n-1 as float32 [n, n_head_kv, head_dim]."""
        return self._decode(layer, 0, n), self._decode(layer, 1, n)

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.n_tokens, (n, self.n_tokens)
        self.n_tokens = n

    def check_integrity(self) -> None:
        assert 0 <= self.n_tokens <= self.n_ctx, f"KV n_tokens {self.n_tokens} outside 0..{self.n_ctx}"

    # -- codecs -------------------------------------------------------------------------
    def _encode(self, x: Any) -> tuple[Any, Any]:
        xp = self.xp
        if self.kind == "f16":
            return x.astype(xp.float16), None
        if self.kind == "int8":
            s = xp.max(xp.abs(x), axis=-1, keepdims=True) / 127.0  # [T, H, 1]
            s = xp.where(s == 0, 1.0, s).astype(xp.float32)
            return xp.clip(xp.rint(x / s), -127, 127).astype(xp.int8), s
        t, h, d = x.shape
        blocks = x.reshape(t, h, d // Q4_BLOCK, Q4_BLOCK)  # [T, H, B, 32]
        idx = xp.argmax(xp.abs(blocks), axis=-1)[..., None]
        signed_max = xp.take_along_axis(blocks, idx, axis=-1)  # [T, H, B, 1]
        scale = (signed_max / -8.0).astype(xp.float16)
        s32 = scale.astype(xp.float32)
        inv = xp.where(s32 == 0, 0.0, 1.0 / xp.where(s32 == 0, 1.0, s32))  # no 1/0 for empty blocks
        q = xp.clip(xp.floor(blocks * inv + 8.5), 0, 15).astype(xp.uint8)  # [T, H, B, 32]
        packed = q[..., : Q4_BLOCK // 2] | (q[..., Q4_BLOCK // 2 :] << 4)  # [T, H, B, 16]
        return packed.reshape(t, h, d // 2), scale[..., 0]

    def _decode(self, layer: int, j: int, n: int) -> Any:
        xp = self.xp
        q = self.data[layer, j, :n]
        if self.kind == "f16":
            return q.astype(xp.float32)
        s = self.scale[layer, j, :n]
        if self.kind == "q4_0" and xp.__name__ == "cupy":  # one fused launch
            from engine.kernels.fused import kv_q4_decode

            return kv_q4_decode(q, s)
        if self.kind == "int8":
            return q.astype(xp.float32) * s
        t, h, _ = q.shape
        blocks = q.reshape(t, h, -1, Q4_BLOCK // 2)  # [n, H, B, 16]
        lo = (blocks & 0x0F).astype(xp.int8) - 8
        hi = (blocks >> 4).astype(xp.int8) - 8
        vals = xp.concatenate([lo, hi], axis=-1).astype(xp.float32)  # [n, H, B, 32]
        vals *= s.astype(xp.float32)[..., None]
        return vals.reshape(t, h, self.head_dim)
