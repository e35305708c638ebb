"""Kernels of the token graph (engine/kernels/decode.cu): decode-step attention straight from the
KV cache's cells, the KV write and the MoE job table, all reading the step's position and the
expert residency from device memory, so a captured CUDA graph replays unchanged every step.

- `attention_at(q [T, H, D], cells, pos, ws)` -> [T, H, D]: causal attention of rows at
  positions pos[0].. over cells 0..pos[0]+t of one layer (q4_0 or f16 cells, no decoded copy;
  `cells`: the layer's `engine.backend.base.KVCells`, views of every cell);
- `kv_write_at(cells, k, v, pos)`: k, v [T, Hkv, D] into one layer's cells pos[0]..;
- `moe_at(...)`: the routed FFN of a few tokens with weights read from the cache slot the staged
  residency table names, or over PCIe from the page-locked GGUF on a miss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf.quant import ExpertLayout
from engine.kernels.dequant import gemv_jobs
from engine.kernels.fused import kv_q4_encode
from engine.kernels.moe import _dims, _silu_mul
from engine.kernels.source import cuda_source

KEYS = 128  # keys per attention tile (threads per block); as in decode.cu
MERGE_SLICES = 4  # attn_merge: tile slices per block (SLICES in decode.cu); 4 * D <= 1024
GRAPH_KV_KINDS = ("q4_0", "f16")


def _kv_struct(kind: str, d: int) -> str:
    return {"q4_0": f"KvQ4<{d}>", "f16": f"KvF16<{d}>"}[kind]


@functools.cache
def _module(kind: str, group: int, d: int) -> Any:
    import cupy

    names = (f"attn_tiles<{_kv_struct(kind, d)}, {group}, {d}>", f"attn_merge<{d}>")
    module = cupy.RawModule(code=cuda_source("decode.cu"), options=("-std=c++17",),
                            name_expressions=names)
    return module, names


@functools.cache
def _plain() -> Any:
    import cupy

    return cupy.RawModule(code=cuda_source("decode.cu"), options=("-std=c++17",))


def _fn(name: str) -> Any:
    return _plain().get_function(name)


def preload() -> None:
    """Compile and load the shape-free decode kernels now (attention's take the KV's shape)."""
    _fn("kv_f16_write")


def n_tiles(n_ctx: int) -> int:
    return -(-n_ctx // KEYS)


def attention_workspace(t: int, n_head: int, d: int, n_ctx: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the tile partials: (max, sum) [T, H, tiles, 2] and weighted V [T, H, tiles, D]."""
    n = n_tiles(n_ctx)
    return (t, n_head, n, 2), (t, n_head, n, d)


def attention_at(q: Any, cells: Any, pos: Any, ml: Any, acc: Any) -> Any:
    """q [T, H, D] float32 (normed, rotated) -> [T, H, D] over the layer's cells 0..pos[0]+t.

    `ml`, `acc`: float32 workspaces of `attention_workspace` shapes (tiles cover all n_ctx cells;
    tiles past a row's position return at once)."""
    import cupy

    t, n_head, d = q.shape
    assert cells.kind in GRAPH_KV_KINDS and q.dtype == cupy.float32 and q.flags.c_contiguous
    n_kv = cells.n_head_kv
    group = n_head // n_kv
    module, (tiles_name, merge_name) = _module(cells.kind, group, d)
    nt = n_tiles(cells.n_ctx)
    assert ml.shape == (t, n_head, nt, 2) and acc.shape == (t, n_head, nt, d)
    k_arg = _kv_arg(cells.k, cells.k_scale)
    v_arg = _kv_arg(cells.v, cells.v_scale)
    scale = np.float32(1.0 / float(d) ** 0.5)
    module.get_function(tiles_name)(
        (nt, n_kv, t), (KEYS,),
        (q, *k_arg, *v_arg, pos, np.int32(n_kv), scale, np.int32(nt), ml, acc))
    out = cupy.empty_like(q)
    module.get_function(merge_name)((n_head, t), (MERGE_SLICES * d,),
                                    (ml, acc, pos, np.int32(n_head), np.int32(nt), out))
    return out


def _kv_arg(cells: Any, scale: Any) -> tuple[np.uint64, np.uint64]:
    """A KV operand as the kernel takes it: cells and scales addresses (0: none)."""
    return np.uint64(cells.data.ptr), np.uint64(0 if scale is None else scale.data.ptr)


def kv_write_at(cells: Any, k: Any, v: Any, pos: Any) -> None:
    """Store k, v [T, Hkv, D] float32 at cells pos[0].. of one layer (q4_0 or f16 cells)."""
    for x, data, scale in ((k, cells.k, cells.k_scale), (v, cells.v, cells.v_scale)):
        if cells.kind == "q4_0":
            kv_q4_encode(x, data, scale, pos=pos)
            continue
        n = x.size
        per_cell = x.shape[1] * x.shape[2]  # Hkv * D values a cell
        _fn("kv_f16_write")((-(-n // 256),), (256,), (x, data, np.int64(n), np.int64(per_cell), pos))


@dataclass(frozen=True)
class ExpertSource:
    """Where a layer's experts are on the device: cache slots and the mapped GGUF.

    `table`: int32 [E] slot or -1 (a row of the staged residency table); `slot_base`: address
    of slot 0, `slot_bytes` apart, gate | up | down at `offsets` (the layer's `layout`: its
    quant types and part sizes; a slot may be longer than the layer's blob); `host`: uint64 [3]
    device addresses of the layer's gate/up/down expert tensors in the page-locked file,
    `part_bytes` int64 [3] apart per expert; `counts`: where the kernel counts hits and misses."""

    table: Any
    slot_base: int
    slot_bytes: int
    offsets: tuple[int, int]
    host: Any
    part_bytes: Any
    layout: ExpertLayout
    counts: Any  # uint64 [2]: the layer's expert hits and misses so far (the kernel adds)


def moe_at(h: Any, ids: Any, w: Any, src: ExpertSource) -> Any:
    """h [T, d] float32, ids [T, k] int64, w [T, k] -> [T, d]: the routed FFN through the fused
    GEMV kernels, with job rows built on the device (`moe_jobs`); `src.counts` gains the hits
    and misses."""
    import cupy

    layout = src.layout
    f, d = _dims(layout)
    n_tok, k = ids.shape
    n_pairs = n_tok * k
    gu = cupy.empty((2, n_pairs, f), dtype=cupy.float32)  # gate, up
    act = cupy.empty((n_pairs, f), dtype=cupy.float32)
    y = cupy.empty((n_pairs, d), dtype=cupy.float32)
    jobs_gu = cupy.empty((2 * n_pairs, 3), dtype=cupy.uint64)
    jobs_down = cupy.empty((n_pairs, 3), dtype=cupy.uint64)
    _fn("moe_jobs")(
        (-(-n_pairs // 128),), (128,),
        (ids, np.int32(n_pairs), np.int32(k), src.table, np.uint64(src.slot_base),
         np.int64(src.slot_bytes), np.int64(src.offsets[0]), np.int64(src.offsets[1]),
         src.host, src.part_bytes, np.uint64(h.data.ptr), np.uint64(gu.data.ptr),
         np.uint64(act.data.ptr), np.uint64(y.data.ptr), np.int32(d), np.int32(f),
         jobs_gu, jobs_down, src.counts))  # fmt: skip
    q_gate, q_up, q_down = layout.qtypes
    if q_gate == q_up:
        gemv_jobs(jobs_gu, q_gate, (f, d))
    else:
        gemv_jobs(jobs_gu[:n_pairs], q_gate, (f, d))
        gemv_jobs(jobs_gu[n_pairs:], q_up, (f, d))
    _silu_mul()(gu[0], gu[1], act)
    gemv_jobs(jobs_down, q_down, (d, f))
    out = cupy.empty((n_tok, d), dtype=cupy.float32)
    wc = cupy.ascontiguousarray(w, dtype=cupy.float32)
    _fn("moe_weighted_sum")((n_tok,), (256,), (y, wc, out, np.int32(k), np.int32(d)))
    return out
