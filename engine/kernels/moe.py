"""Routed-expert FFN on CUDA: prefill through fp16 GEMMs, decode through fused GEMVs.

Prefill (`moe_prefill`), for a chunk of T tokens routed to k experts each:

1. sort the T*k (token, expert) rows by expert (on the device; from the per-expert row counts
   the caller read, `plan_rows` places every row);
2. order the used experts by row count and take them in groups that fit the scratch: decode the
   gate|up|down parts of a group in one launch per quant type (`dequantize_many`), gather the
   group's token rows padded to its largest expert (rounded up to `ROW_ALIGN` rows) straight
   from the fp16 activations, and run
   two strided-batched cuBLAS GEMMs per group ([m, d] @ [d, 2f] for gate|up, [m, f] @ [f, d]
   for down; fp16 operands, fp32 accumulation) with one `silu(gate) * up` launch in between,
   the down GEMM writing into the group's rows of one padded output buffer;
3. out[t] = sum_j w[t, j] * y[padded row of (t, j)] in one deterministic launch (no atomics).

Decode (`moe_decode`), for B <= a few tokens: gate and up of every (token, expert) pair in one
`gemv_many` launch, `silu(gate) * up`, down in one more, and the weighted sum.

The kernels read nothing back: the caller (the model's `moe_block`, through the backend's
counted download) brings the row counts, or a decode step's ids, to the host once per layer and
passes them in; small launch tables (row indices, pointers) go the other way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf.quant import ExpertLayout
from engine.kernels.dequant import dequantize_ptrs, gemv_ptrs
from engine.kernels.source import cuda_source

DEFAULT_SCRATCH_BYTES = 256 << 20
# a group's GEMM rows are a multiple of this: a routing of a new size reuses the GEMM shapes
# cuBLAS has already chosen an algorithm for (a new shape costs a heuristic query on the host)
ROW_ALIGN = 64
_ONE, _ZERO = np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.float32)  # cuBLAS alpha, beta


def _cupy() -> Any:
    import cupy

    return cupy


@functools.cache
def _kernels() -> tuple[Any, Any]:
    cp = _cupy()
    module = cp.RawModule(code=cuda_source("moe.cu"), options=("-std=c++17",))
    return module.get_function("swiglu"), module.get_function("combine")


def preload() -> None:
    """Compile and load the MoE's SwiGLU and combine kernels now."""
    _kernels()


def gemm_nt(a: Any, w: Any, out: Any) -> Any:
    """out[g] = a[g] @ w[g].T for every g: a [G, m, K], w [G, N, K], out [G, m, N], all fp16
    and contiguous; one strided-batched cuBLAS call, fp32 accumulation."""
    cp = _cupy()
    from cupy_backends.cuda.libs import cublas

    n_group, m, k = a.shape
    n = w.shape[1]
    assert w.shape == (n_group, n, k) and out.shape == (n_group, m, n), (
        a.shape,
        w.shape,
        out.shape,
    )
    assert all(t.dtype == cp.float16 and t.flags.c_contiguous for t in (a, w, out))
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    f16 = cp.cuda.runtime.CUDA_R_16F
    # column-major view: out^T [N, m] = (w [N, K] as K x N)^T @ (a as K x m)
    cublas.gemmStridedBatchedEx(
        handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, m, k,
        _ONE.ctypes.data, w.data.ptr, f16, k, n * k,
        a.data.ptr, f16, k, m * k,
        _ZERO.ctypes.data, out.data.ptr, f16, n, m * n,
        n_group, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip
    return out


def _dims(layout: ExpertLayout) -> tuple[int, int]:
    (f, d), up, down = layout.shapes
    assert up == (f, d) and down == (d, f), f"expert shapes {layout.shapes}: want [f,d] [f,d] [d,f]"
    return f, d


def expert_fp16_bytes(layout: ExpertLayout) -> int:
    """Scratch bytes of one decoded expert (gate | up | down in fp16)."""
    f, d = _dims(layout)
    return 3 * f * d * 2


def _part_ptrs(blob: Any, layout: ExpertLayout) -> tuple[int, int, int]:
    """Device addresses of the gate, up and down bytes of one expert blob."""
    n_gate, n_up, _ = layout.part_bytes
    assert blob.nbytes >= layout.blob_bytes, f"{blob.nbytes} bytes < layout {layout.blob_bytes}"
    base = blob.data.ptr
    return base, base + n_gate, base + n_gate + n_up


def _decode_group(blobs: list[Any], layout: ExpertLayout, wgu: Any, wd: Any) -> None:
    """Decode experts into wgu[i] = gate | up [2f, d] and wd[i] = down [d, f] (fp16).

    Works on addresses (no cupy view per part): this runs for every expert of every layer."""
    f, d = _dims(layout)
    assert wgu.dtype == wd.dtype and wgu.flags.c_contiguous and wd.flags.c_contiguous
    n = len(blobs)
    parts = [_part_ptrs(b, layout) for b in blobs]
    gate_dst = [wgu.data.ptr + i * 2 * f * d * 2 for i in range(n)]
    up_dst = [p + f * d * 2 for p in gate_dst]
    down_dst = [wd.data.ptr + i * d * f * 2 for i in range(n)]
    dev = wgu.device.id
    q_gate, q_up, q_down = layout.qtypes
    if q_gate == q_up == q_down:  # gate, up and down hold f * d values each: one launch
        srcs = [p[i] for i in range(3) for p in parts]
        dequantize_ptrs(srcs, gate_dst + up_dst + down_dst, q_gate, f * d, f16=True, device_id=dev)
        return
    if q_gate == q_up:
        srcs = [p[0] for p in parts] + [p[1] for p in parts]
        dequantize_ptrs(srcs, gate_dst + up_dst, q_gate, f * d, f16=True, device_id=dev)
    else:
        dequantize_ptrs([p[0] for p in parts], gate_dst, q_gate, f * d, f16=True, device_id=dev)
        dequantize_ptrs([p[1] for p in parts], up_dst, q_up, f * d, f16=True, device_id=dev)
    dequantize_ptrs([p[2] for p in parts], down_dst, q_down, d * f, f16=True, device_id=dev)


def _groups(by_count: list[int], n_per: list[int], group: int, row_cap: int,
            staged: list[bool] | None = None, max_staged: int = 0) -> list[list[int]]:
    """Experts (sorted by row count, largest first) cut into groups of at most `group`, each
    group's padded rows (members x its largest count) kept under `row_cap` unless one expert
    alone exceeds it: skewed routing must not pad every expert to the busiest one. With
    `staged` (per expert: needs a ring slot), a group also holds at most `max_staged` of those."""
    out: list[list[int]] = []
    n_staged: list[int] = []
    for u in by_count:
        s = int(staged[u]) if staged is not None else 0
        if (out and len(out[-1]) < group and (len(out[-1]) + 1) * n_per[out[-1][0]] <= row_cap
                and (staged is None or n_staged[-1] + s <= max_staged)):
            out[-1].append(u)
            n_staged[-1] += s
        else:
            out.append([u])
            n_staged.append(s)
    return out


@dataclass(frozen=True)
class RowPlan:
    """Where the grouped GEMMs put each (token, expert) row, computed on the host from the
    per-expert row counts (rows sorted by expert: expert u's rows are starts[u]..starts[u+1]).

    Group g's experts run as one batch of `len(groups[g])` GEMMs of `m[g]` rows (its busiest
    member's count) on padded rows base[g] .. base[g] + len(groups[g]) * m[g] of one buffer,
    member i on rows base[g] + i * m[g] + (0 .. its count). `padded[s]` is the padded row of
    sorted row s; `source[p]` the sorted row behind padded row p (n_rows where it is padding)."""

    groups: list[list[int]]  # indices into the used experts
    m: list[int]
    base: list[int]
    padded: np.ndarray  # [n_rows] int32
    source: np.ndarray  # [n_padded] int32


def plan_rows(n_per: list[int], group: int, staged: list[bool] | None = None,
              max_staged: int = 0, row_align: int = 1) -> RowPlan:
    """The `RowPlan` of experts with row counts `n_per` in groups of at most `group` (and at
    most `max_staged` experts that need a ring slot, when `staged` says which do), each
    group's rows per member rounded up to a multiple of `row_align`; vectorised: this runs
    for every layer of every prompt chunk."""
    counts = np.asarray(n_per, dtype=np.int64)  # [n_used]
    n_rows = int(counts.sum())
    by_count = sorted(range(len(n_per)), key=lambda i: (-n_per[i], i))
    groups = _groups(by_count, n_per, group, max(n_rows // 2, 1), staged, max_staged)
    ms = [-(-n_per[g[0]] // row_align) * row_align for g in groups]
    bases = np.concatenate([[0], np.cumsum([len(g) * m for g, m in zip(groups, ms)])])
    first = np.empty(len(n_per), dtype=np.int64)  # [n_used] padded row of each expert's row 0
    for g, m, b in zip(groups, ms, bases):
        first[g] = b + m * np.arange(len(g))
    starts = np.cumsum(counts) - counts  # [n_used]
    within = np.arange(n_rows) - np.repeat(starts, counts)  # [n_rows] index inside its expert
    padded = (np.repeat(first, counts) + within).astype(np.int32)
    source = np.full(int(bases[-1]), n_rows, dtype=np.int32)  # [n_padded]
    source[padded] = np.arange(n_rows, dtype=np.int32)
    return RowPlan(groups, ms, [int(b) for b in bases[:-1]], padded, source)


def _swiglu(gu: Any, act: Any) -> None:
    """act [rows, f] = silu(gu[:, :f]) * gu[:, f:] for gu [rows, 2f] (fp16)."""
    swiglu, _ = _kernels()
    n_rows, f = act.shape
    blocks = min((n_rows * f + 255) // 256, 8192)
    swiglu((blocks,), (256,), (gu, act, np.int64(n_rows), np.int32(f)))


def moe_prefill(
    h: Any,
    ids: Any,
    weights: Any,
    blobs: Mapping[int, Any] | Callable[[list[int]], list[Any]],
    layout: ExpertLayout,
    *,
    counts: np.ndarray,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    max_group: int | None = None,
    release: Callable[[list[int]], None] | None = None,
    staged: Callable[[int], bool] | None = None,
    lap: Callable[[str], None] | None = None,
) -> Any:
    """Routed-expert FFN of a token chunk on the GPU (see the module docstring).

    h: [T, d] fp16/fp32 (normed) activations; ids: [T, k] int expert ids (a token names an
    expert at most once); weights: [T, k] routing weights; blobs: expert id -> uint8 device
    array of its gate|up|down bytes (`ExpertLayout`), for every id in `ids`, as a mapping or
    a function of a list of ids (-> their arrays). A function is called once per group of at
    most `max_group` experts, after the previous group's fp16 decode is queued (so a staging
    ring of `max_group` slots can hold every group in turn; with `staged(id)`, true for the
    experts that need a ring slot, `max_group` bounds only those); `release(ids)` (optional) is
    told the moment the decode of those experts' blobs is queued, before their GEMMs, so the
    next group's uploads can overlap the GEMMs of this one. `counts` (host [E]): rows per
    expert id (the caller reads the routing once; the kernel reads nothing back). `lap`
    (optional) marks where each stage ends, in stream order: 'moe route' (all since the
    previous mark: router, top-k, the routing's host read), then per group 'moe fetch+decode'
    and 'moe gemm' (the prefill phases STRATA_TRACE prints).
    Returns float32 [T, d]: sum_j weights[t, j] * down(silu(gate h_t) * up h_t) of expert ids[t, j].
    """
    cp = _cupy()
    _, combine = _kernels()
    lap = lap or _no_lap
    f, d = _dims(layout)
    n_tok, k = ids.shape
    assert h.shape == (n_tok, d), f"h {h.shape} for {n_tok} tokens of width {d}"
    n_rows = n_tok * k
    flat = cp.asarray(ids, dtype=cp.int32).reshape(-1)  # [T*k]
    order = cp.argsort(flat).astype(cp.int32)  # [T*k] rows sorted by expert
    used = np.flatnonzero(counts).tolist()
    n_per = [int(counts[e]) for e in used]
    assert sum(n_per) == n_rows, f"expert row counts sum to {sum(n_per)}, not {n_rows}"
    lap("moe route")  # router, top-k and the host read of the routing (STRATA_TRACE)
    fetch = (lambda es: [blobs[e] for e in es]) if isinstance(blobs, Mapping) else blobs
    group = min(max(1, scratch_bytes // expert_fp16_bytes(layout)), len(used))
    if staged is not None and max_group is not None:  # resident experts take no ring slot
        plan = plan_rows(n_per, group, [staged(e) for e in used], max_group, ROW_ALIGN)
    else:
        group = min(group, max_group or group)
        plan = plan_rows(n_per, group, row_align=ROW_ALIGN)
    tok = cp.empty(n_rows + 1, dtype=cp.int32)  # [T*k + 1] token of each sorted row
    tok[:n_rows] = order // k
    tok[n_rows] = n_tok  # padding rows read the zero row
    tok_padded = tok[cp.asarray(plan.source)]  # [padded rows] token behind each
    h16 = cp.empty((n_tok + 1, d), dtype=cp.float16)  # [T + 1, d]; last row zeros
    h16[:n_tok] = h
    h16[n_tok] = 0
    y = cp.empty((len(plan.source), d), dtype=cp.float16)  # [padded rows, d] expert outputs
    wgu = cp.empty((group, 2 * f, d), dtype=cp.float16)  # gate | up of each expert
    wd = cp.empty((group, d, f), dtype=cp.float16)
    pending = fetch([used[u] for u in plan.groups[0]])
    for gi, members in enumerate(plan.groups):
        n_g, m, base = len(members), plan.m[gi], plan.base[gi]
        _decode_group(pending, layout, wgu, wd)
        lap("moe fetch+decode")  # the group's blobs staged (ring uploads) and decoded to fp16
        if release is not None:
            release([used[u] for u in members])
        if gi + 1 < len(plan.groups):  # the blobs are read (decode queued): the next group's
            pending = fetch([used[u] for u in plan.groups[gi + 1]])  # uploads overlap these GEMMs
        a = cp.take(h16, tok_padded[base : base + n_g * m], axis=0).reshape(n_g, m, d)
        gu = gemm_nt(a, wgu[:n_g], cp.empty((n_g, m, 2 * f), dtype=cp.float16))
        act = cp.empty((n_g, m, f), dtype=cp.float16)
        _swiglu(gu.reshape(n_g * m, 2 * f), act.reshape(n_g * m, f))
        gemm_nt(act, wd[:n_g], y[base : base + n_g * m].reshape(n_g, m, d))  # [n_g, m, d]
        lap("moe gemm")  # gather, gate|up GEMM, SwiGLU, down GEMM
    pos = cp.empty(n_rows, dtype=cp.int32)  # [T*k] padded output row of (t, j)
    pos[order] = cp.asarray(plan.padded)
    out = cp.empty((n_tok, d), dtype=cp.float32)
    w = cp.ascontiguousarray(weights, dtype=cp.float32)  # [T, k]
    combine((n_tok,), (256,), (y, pos.reshape(n_tok, k), w, out, np.int32(k), np.int32(d)))
    return out


def _no_lap(stage: str) -> None:
    pass


@functools.cache
def _silu_mul() -> Any:
    cp = _cupy()
    return cp.ElementwiseKernel(
        "float32 g, float32 u", "float32 a", "a = g / (1.0f + expf(-g)) * u", "strata_silu_mul"
    )


def moe_decode(
    h: Any, ids: np.ndarray, weights: Any, blobs: Mapping[int, Any], layout: ExpertLayout
) -> Any:
    """Routed-expert FFN of a few tokens through fused dequantize-GEMV (no decoded copies).

    h: [B, d] activations; ids: [B, k] on the host (the job tables are built from them);
    weights: [B, k]. Returns float32 [B, d]. Three GEMV launches at most (gate|up together when
    they share a quant type, then down).
    """
    cp = _cupy()
    f, d = _dims(layout)
    ids_h = np.asarray(ids)
    n_tok, k = ids_h.shape
    n_pairs = n_tok * k  # job order: (token, slot)
    hx = cp.ascontiguousarray(h, dtype=cp.float32)  # [B, d]
    parts = np.array([_part_ptrs(blobs[int(e)], layout) for e in ids_h.reshape(-1)], np.uint64)
    tok = np.repeat(np.arange(n_tok, dtype=np.uint64), k)  # [B*k]
    pair = np.arange(n_pairs, dtype=np.uint64)
    gu = cp.empty((2, n_pairs, f), dtype=cp.float32)  # gate, up
    act = cp.empty((n_pairs, f), dtype=cp.float32)
    y = cp.empty((n_pairs, d), dtype=cp.float32)
    x_ptrs = hx.data.ptr + tok * np.uint64(d * 4)
    gate = np.stack([parts[:, 0], x_ptrs, gu.data.ptr + pair * np.uint64(f * 4)], axis=1)
    up = np.stack(
        [parts[:, 1], x_ptrs, gu.data.ptr + (pair + np.uint64(n_pairs)) * np.uint64(f * 4)], axis=1
    )
    down = np.stack(
        [parts[:, 2], act.data.ptr + pair * np.uint64(f * 4), y.data.ptr + pair * np.uint64(d * 4)],
        axis=1,
    )
    q_gate, q_up, q_down = layout.qtypes
    dev = hx.device.id
    if q_gate == q_up:
        gemv_ptrs(np.concatenate([gate, up]), q_gate, (f, d), 1, device_id=dev)
    else:
        gemv_ptrs(gate, q_gate, (f, d), 1, device_id=dev)
        gemv_ptrs(up, q_up, (f, d), 1, device_id=dev)
    _silu_mul()(gu[0], gu[1], act)
    gemv_ptrs(down, q_down, (d, f), 1, device_id=dev)
    w = cp.asarray(weights, dtype=cp.float32).reshape(n_tok, k, 1)
    return (y.reshape(n_tok, k, d) * w).sum(axis=1)  # [B, d]
