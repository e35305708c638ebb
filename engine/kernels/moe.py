"""Prefill MoE on CUDA: decode each used expert to fp16, grouped cuBLAS GEMMs, weighted combine.

For a chunk of T tokens routed to k experts each:

1. sort the T*k (token, expert) rows by expert; gather the activations in that order;
2. for a group of experts that fits the scratch: decode every gate|up|down part of the group in
   one launch per quant type (`dequantize_many`), then per expert two cuBLAS GEMMs on its
   contiguous rows ([n_e, d] @ [d, 2f] for gate|up, [n_e, f] @ [f, d] for down) with one
   `silu(gate) * up` launch for the whole group in between;
3. out[t] = sum_j w[t, j] * y[row of (t, j)] in one deterministic launch (no atomics).

GEMMs take fp16 operands and accumulate in fp32 (cuBLAS compute type set for CuPy's fp16
matmul on first use). The expert ids and row counts come to the host once per call (two small
arrays: the GEMM shapes need them).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.kernels.dequant import dequantize_many

if TYPE_CHECKING:
    from engine.model.weights import ExpertLayout

_DIR = Path(__file__).parent
DEFAULT_SCRATCH_BYTES = 256 << 20


def _cupy() -> Any:
    import cupy

    return cupy


@functools.cache
def _kernels() -> tuple[Any, Any]:
    cp = _cupy()
    from cupy._core import _routines_linalg as linalg

    # CuPy's fp16 matmul: fp32 accumulation inside cuBLAS (the default may accumulate in fp16).
    linalg.set_compute_type(cp.float16, linalg.COMPUTE_TYPE_FP32)
    module = cp.RawModule(code=(_DIR / "moe.cu").read_text(), options=("-std=c++17",))
    return module.get_function("swiglu"), module.get_function("combine")


def _dims(layout: ExpertLayout) -> tuple[int, int]:
    (f, d), up, down = layout.shapes
    assert up == (f, d) and down == (d, f), f"expert shapes {layout.shapes}: want [f,d] [f,d] [d,f]"
    return f, d


def expert_fp16_bytes(layout: ExpertLayout) -> int:
    """Scratch bytes of one decoded expert (gate | up | down in fp16)."""
    f, d = _dims(layout)
    return 3 * f * d * 2


def workspace_bytes(n_tokens: int, n_used: int, layout: ExpertLayout, scratch_bytes: int) -> int:
    """Device bytes one `moe_prefill` call allocates (for planning the prompt path)."""
    f, d = _dims(layout)
    rows = n_tokens * n_used
    group = max(1, scratch_bytes // expert_fp16_bytes(layout))
    decoded = group * expert_fp16_bytes(layout)
    return decoded + rows * (d + 2 * f + f + d) * 2 + rows * 4 * 3 + n_tokens * d * 4


def _decode_group(
    blobs: Mapping[int, Any], experts: list[int], layout: ExpertLayout, wgu: Any, wd: Any
) -> None:
    """Decode experts into wgu[i] = gate | up [2f, d] and wd[i] = down [d, f] (fp16)."""
    f, d = _dims(layout)
    n_gate, n_up, n_down = layout.part_bytes
    parts = []
    for e in experts:
        blob = blobs[e]
        assert blob.nbytes >= layout.blob_bytes, f"expert {e}: {blob.nbytes} bytes < layout"
        parts.append((blob[:n_gate], blob[n_gate : n_gate + n_up], blob[n_gate + n_up :]))
    n = len(experts)
    q_gate, q_up, q_down = layout.qtypes
    if q_gate == q_up:
        srcs = [p[0] for p in parts] + [p[1] for p in parts]
        outs = [wgu[i, :f] for i in range(n)] + [wgu[i, f:] for i in range(n)]
        dequantize_many(srcs, q_gate, (f, d), outs)
    else:
        dequantize_many([p[0] for p in parts], q_gate, (f, d), [wgu[i, :f] for i in range(n)])
        dequantize_many([p[1] for p in parts], q_up, (f, d), [wgu[i, f:] for i in range(n)])
    dequantize_many([p[2] for p in parts], q_down, (d, f), [wd[i] for i in range(n)])


def moe_prefill(
    h: Any,
    ids: Any,
    weights: Any,
    blobs: Mapping[int, Any],
    layout: ExpertLayout,
    *,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> Any:
    """Routed-expert FFN of a token chunk on the GPU.

    h: [T, d] fp16/fp32 (normed) activations; ids: [T, k] int expert ids (a token names an
    expert at most once); weights: [T, k] routing weights; blobs: expert id -> uint8 device
    array of its gate|up|down bytes (`ExpertLayout`), for every id in `ids`.
    Returns float32 [T, d]: sum_j weights[t, j] * down(silu(gate h_t) * up h_t) of expert ids[t, j].
    """
    cp = _cupy()
    swiglu, combine = _kernels()
    f, d = _dims(layout)
    n_tok, k = ids.shape
    assert h.shape == (n_tok, d), f"h {h.shape} for {n_tok} tokens of width {d}"
    n_rows = n_tok * k
    flat = cp.ascontiguousarray(ids, dtype=cp.int32).reshape(-1)  # [T*k]
    order = cp.argsort(flat).astype(cp.int32)  # [T*k] rows sorted by expert
    experts, counts = cp.unique(flat, return_counts=True)
    used, n_per = (a.tolist() for a in cp.stack([experts, counts.astype(cp.int32)]).get())
    starts = np.concatenate([[0], np.cumsum(n_per)]).tolist()  # [n_used + 1]
    pos = cp.empty(n_rows, dtype=cp.int32)  # [T*k] sorted row of (t, j)
    pos[order] = cp.arange(n_rows, dtype=cp.int32)
    hs = cp.ascontiguousarray(h, dtype=cp.float16)[order // k]  # [T*k, d]

    group = max(1, scratch_bytes // expert_fp16_bytes(layout))
    group = min(group, len(used))
    wgu = cp.empty((group, 2 * f, d), dtype=cp.float16)  # gate | up of each expert
    wd = cp.empty((group, d, f), dtype=cp.float16)
    gu = cp.empty((n_rows, 2 * f), dtype=cp.float16)
    act = cp.empty((n_rows, f), dtype=cp.float16)
    y = cp.empty((n_rows, d), dtype=cp.float16)
    for g0 in range(0, len(used), group):
        members = used[g0 : g0 + group]
        _decode_group(blobs, members, layout, wgu, wd)
        for i in range(len(members)):
            a, b = starts[g0 + i], starts[g0 + i + 1]
            cp.matmul(hs[a:b], wgu[i].T, out=gu[a:b])  # [n_e, 2f]
        ra, rb = starts[g0], starts[g0 + len(members)]
        n_act = (rb - ra) * f
        swiglu(
            (min((n_act + 255) // 256, 8192),),
            (256,),
            (gu[ra:rb], act[ra:rb], np.int64(rb - ra), np.int32(f)),
        )
        for i in range(len(members)):
            a, b = starts[g0 + i], starts[g0 + i + 1]
            cp.matmul(act[a:b], wd[i].T, out=y[a:b])  # [n_e, d]
    out = cp.empty((n_tok, d), dtype=cp.float32)
    w = cp.ascontiguousarray(weights, dtype=cp.float32)  # [T, k]
    pos_tk = pos.reshape(n_tok, k)  # [T, k]
    combine((n_tok,), (256,), (y, pos_tk, w, out, np.int32(k), np.int32(d)))
    return out
