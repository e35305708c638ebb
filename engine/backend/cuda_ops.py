"""The model's ops on CUDA: the kernels (engine/kernels/) where one applies, the array ops on
CuPy (engine/backend/array_ops.py) where none does.

- `linear`: up to `GEMV_MAX_ROWS` rows (decode steps) against a contiguous fp16 weight or a
  `QuantMatrix` take the fused GEMV (weights read once in their format, float32 products, one
  launch); more rows go to cuBLAS (a `QuantMatrix` decoded to fp16 first, in row slices of at
  most `DECODE_SLICE_BYTES`);
- `rms_norm`, `rope`, `route`, `expert_counts`, the q4_0 KV codec: one fused launch each
  (kernels/fused.py);
- `attention`: a prompt chunk (T > 1) takes the flash kernel where it handles the head size,
  else cuBLAS GEMMs with a fused softmax; a decode row takes the array code; `attention_at`
  (a captured step: its position on the device) the token graph's kernels over the KV cells;
- `moe`: fused GEMVs on the quantized expert bytes for a decode step without a ring, else
  grouped fp16 GEMMs with experts fetched (and, through a ring, staged) one group at a time;
  `moe_at` (a captured step) GEMVs on job rows built on the device from an expert source;
  `decode_expert`: an expert's bytes to float32 weights through the dequantize kernel;
- `embed`: more than `EMBED_ON_HOST_ROWS` rows go up quantized and are decoded on the device.

`CudaBackend` (engine/backend/cuda.py) takes these with its memory and copies.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np
from gguf import GGMLQuantizationType

from engine.backend.array_ops import ArrayOps
from engine.backend.base import DevicePosition, ExpertProvider, Position, Routing
from engine.config import DECODE_ROWS
from engine.gguf.quant import ExpertLayout, QuantMatrix, QuantStack
from engine.kernels import fused
from engine.kernels.attention import causal_attention
from engine.kernels.decode import GRAPH_KV_KINDS, attention_workspace, kv_write_at
from engine.kernels.decode import attention_at as attention_over_cells
from engine.kernels.decode import moe_at as moe_from_source
from engine.kernels.dequant import DECODE_SLICE_BYTES, GEMV_MAX_ROWS, SUPPORTED, dequantize, gemv
from engine.kernels.flash import flash_attention
from engine.kernels.flash import supported as flash_supported
from engine.kernels.moe import moe_decode, moe_prefill
from engine.trace import phases

# Longer token runs decode their embedding rows on the device: where uploading the quantized
# rows starts to pay, not the decode row limit (`DECODE_ROWS`), though both are 8 today.
EMBED_ON_HOST_ROWS = 8


class CudaOps(ArrayOps):
    """The `Backend` protocol's ops through the CUDA kernels (see the module docstring)."""

    def linear(self, x: Any, w: Any) -> Any:
        few = x.ndim == 2 and x.shape[0] <= GEMV_MAX_ROWS
        if isinstance(w, QuantStack):  # one product per part, side by side
            return cupy.concatenate([self.linear(x, p) for p in w.parts], axis=-1)
        if isinstance(w, QuantMatrix):
            if few:
                return gemv(w.raw, w.qtype, w.shape, x)
            return self._linear_decoded(x, w)
        if few and w.dtype == cupy.float16 and w.flags.c_contiguous:
            return gemv(w.reshape(-1).view(cupy.uint8), GGMLQuantizationType.F16, w.shape, x)
        return super().linear(x, w)

    def _linear_decoded(self, x: Any, w: QuantMatrix) -> Any:
        """x [.., n_in] @ w^T through cuBLAS on w decoded to fp16, a row slice at a time (the
        decoded slice is a temporary: a chunk arena's bytes during a prompt chunk)."""
        n_out, n_in = w.shape
        step = max(1, DECODE_SLICE_BYTES // (2 * n_in))  # weight rows per slice
        if step >= n_out:
            return super().linear(x, dequantize(w.raw, w.qtype, w.shape, np.float16))
        out = cupy.empty((*x.shape[:-1], n_out), dtype=cupy.float32)
        for a in range(0, n_out, step):
            part = w.rows(a, min(n_out, a + step))
            out[..., a : a + part.shape[0]] = super().linear(
                x, dequantize(part.raw, part.qtype, part.shape, np.float16))
        return out

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        if x.dtype == cupy.float32:
            return fused.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def rope(self, x: Any, pos: Position, base: float, n_rot: int = 0) -> Any:
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)
        if isinstance(pos, DevicePosition):  # the kernel adds the device value
            return fused.rope_neox_(x, 0, base, pos=pos.array, n_rot=n_rot)
        return fused.rope_neox_(x, pos, base, n_rot=n_rot)

    def attention(self, q: Any, k: Any, v: Any, pos0: int) -> Any:
        if q.shape[0] > 1:  # a prompt chunk: tensor-core kernels
            attend = flash_attention if flash_supported(q.shape[2]) else causal_attention
            return attend(q, k, v, pos0)  # [T, H, D] float32
        return super().attention(q, k, v, pos0)

    def attention_at(self, q: Any, k: Any, v: Any, cells: Any, pos: DevicePosition) -> Any:
        """The token graph's kernels (q4_0 and f16 cells): the K/V write and the attention
        read the position and the cells in place, tiles past the position return at once."""
        if cells.kind not in GRAPH_KV_KINDS:
            return super().attention_at(q, k, v, cells, pos)
        kv_write_at(cells, k, cupy.ascontiguousarray(v), pos.array)
        ml_shape, acc_shape = attention_workspace(q.shape[0], q.shape[1], q.shape[2], cells.n_ctx)
        ml, acc = cupy.empty(ml_shape, dtype=cupy.float32), cupy.empty(acc_shape, dtype=cupy.float32)
        return attention_over_cells(q, cells, pos.array, ml, acc)  # [T, H, D]

    def route(self, logits: Any, routing: Routing, bias: Any = None) -> tuple[Any, Any, Any]:
        return fused.route_topk(logits, routing, bias)

    def expert_counts(self, ids: Any, n_expert: int) -> np.ndarray:
        return self.download(fused.count_ids(ids, n_expert))

    def moe(self, h: Any, ids: Any, w: Any, used: list[int], counts: np.ndarray,
            experts: ExpertProvider, layer: int) -> Any:
        layout, ring_slots = experts.layout_of(layer), experts.ring_slots
        if h.shape[0] <= DECODE_ROWS and ring_slots is None:  # ids on the host: job tables
            return moe_decode(h, ids, w, dict(zip(used, experts.blobs(layer, used))), layout)
        if isinstance(ids, np.ndarray):  # a short prompt through the ring: ids were read back
            ids = self.to_device(ids)
        fetch = lambda es: experts.blobs(layer, es)
        if ring_slots is None:
            return moe_prefill(h, ids, w, fetch, layout, counts=counts, lap=phases.lap)
        return moe_prefill(h, ids, w, fetch, layout, counts=counts, max_group=ring_slots,
                           release=lambda es: experts.reads_queued(layer, es),
                           staged=lambda e: experts.needs_slot(layer, e), lap=phases.lap)

    def moe_at(self, h: Any, ids: Any, w: Any, source: Any) -> Any:
        """GEMVs on job rows the kernels build from the device ids and the staged residency
        row (`engine.kernels.decode.moe_at`); the source's counters gain its hits and misses."""
        return moe_from_source(h, ids, w, source)

    def decode_expert(self, blob: Any, layout: ExpertLayout) -> tuple[Any, Any, Any]:
        """Each part through the dequantize kernel, float32 out."""
        out, off = [], 0
        for qtype, shape, n in zip(layout.qtypes, layout.shapes, layout.part_bytes):
            out.append(dequantize(blob[off : off + n], qtype, shape, np.float32))
            off += n
        return out[0], out[1], out[2]

    def kv_store(self, kind: str, x: Any, cells: Any, scales: Any) -> None:
        if kind == "q4_0":  # encode straight into the cells: one launch
            fused.kv_q4_encode(x, cells, scales)
            return
        super().kv_store(kind, x, cells, scales)

    def kv_load(self, kind: str, cells: Any, scales: Any, chunk: bool = False) -> Any:
        """A prompt chunk's keys and values in fp16, what the attention kernels read: q4_0
        decoded straight to fp16, f16 cells as they are (no copy); else float32."""
        if chunk and kind == "f16" and cells.flags.c_contiguous:
            return cells
        if kind == "q4_0":
            return fused.kv_q4_decode(cells, scales, f16=chunk)
        return super().kv_load(kind, cells, scales)

    def embed(self, rows: np.ndarray, qtype: GGMLQuantizationType, n_embd: int) -> Any:
        """More than `EMBED_ON_HOST_ROWS` rows go up quantized and are decoded on the device (a
        20k-token chunk: ~45 MB of Q8_0 rows instead of ~170 MB of float32 decoded by numpy)."""
        if len(rows) > EMBED_ON_HOST_ROWS and qtype in SUPPORTED:
            raw = self.to_device(rows)  # [T, row_bytes]
            return dequantize(raw.reshape(-1), qtype, (len(rows), n_embd), np.float32)
        return super().embed(rows, qtype, n_embd)
