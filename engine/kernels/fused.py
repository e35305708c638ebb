"""Fused small ops for CuPy arrays (engine/kernels/fused.cu): one launch where the NumPy-style
code takes 5-12. They matter in the decode step, where every layer runs a handful of tiny ops
and CuPy's per-launch cost (~10-20 us of Python and driver time each) is the step's cost.

- `rms_norm(x [.., n], w [n], eps)` -> float32, one block per row;
- `rope_neox_(x [T, H, D], pos0, base)`: NEOX rotary embedding in place, positions pos0..;
- `kv_q4_encode(x [T, H, D]) -> (packed [T, H, D/2] uint8, scale [T, H, D/32] fp16)` and
  `kv_q4_decode(packed, scale, f16=False) -> float32 (or float16) [n, H, D]`: the q4_0 KV
  codec;
- `route_topk(logits [T, E], routing, bias) -> (ids [T, k] int64, w [T, k], margin [T])`: softmax
  or sigmoid (+ a selection bias), top-k
  (ties: lower index first, as a stable argsort), renormalised weights and the tie margin;
- `count_ids(ids int64, n) -> int32 [n]`: rows per expert (`bincount`), one launch of any size.

Each matches its array-code reference in engine/backend/array_ops.py (`rms_norm`, `rope_neox`,
`kv_encode`/`kv_decode`, `route_topk`) to float32 rounding (tests/test_gpu_fused.py); the q4
codec's rounding steps are the reference's.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from engine.kernels.lifetime import process_lifetime
from engine.kernels.source import cuda_source

_THREADS = 256
_RMS_NAMES = ("rms_norm_rows<float>", "rms_norm_rows<unsigned short>")


def kernel_source() -> str:
    return cuda_source("fused.cu")


@functools.cache
def _module() -> Any:
    import cupy

    # the template instantiations by name expression; the extern "C" kernels by their names
    return cupy.RawModule(code=kernel_source(), options=("-std=c++17",),
                          name_expressions=_RMS_NAMES)


def _fn(name: str) -> Any:
    return _module().get_function(name)


def preload() -> None:
    """Compile (NVRTC, or CuPy's disk cache) and load this module's kernels now, so the CUDA
    backend measures them before it plans (engine/kernels/warmup.py)."""
    _fn(_RMS_NAMES[0])


def _ptr(a: Any) -> np.uint64:
    """A kernel's optional pointer argument: the array's address, or 0."""
    return np.uint64(0 if a is None else a.data.ptr)


def _blocks(n: int) -> tuple[int]:
    return (int(-(-n // _THREADS)),)


def rms_norm(x: Any, w: Any, eps: float) -> Any:
    """x [.., n] float32 -> x / sqrt(mean(x^2) + eps) * w (w float32 or float16 [n])."""
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    n = x.shape[-1]
    assert w.shape == (n,) and w.dtype in (cupy.float32, cupy.float16), (w.shape, w.dtype)
    y = cupy.empty_like(x)
    rows = x.size // n
    if rows:
        name = _RMS_NAMES[0] if w.dtype == cupy.float32 else _RMS_NAMES[1]
        threads = min(_THREADS, max(32, -(-n // 32) * 32))
        _fn(name)((rows,), (threads,), (x, cupy.ascontiguousarray(w), y, np.int32(n), np.float32(eps)))
    return y


@functools.cache
def _inv_freq(d: int, base: float, device_id: int) -> Any:
    """float32 [d/2]: base^(-2i/d), computed as the array reference `rope_neox` does (host numpy,
    float32), kept for the process (from the default pool, never from a chunk arena)."""
    import cupy

    host = base ** (-np.arange(0, d // 2, dtype=np.float32) * 2.0 / d)
    with cupy.cuda.Device(device_id), process_lifetime():
        return cupy.asarray(host.astype(np.float32))


def rope_neox_(x: Any, pos0: int, base: float, pos: Any = None, n_rot: int = 0) -> Any:
    """Rotate x [T, H, D] (float32, contiguous) in place; query t at position pos0 + t, plus
    pos[0] when `pos` (int32 device array) is given: the token graph's step position. `n_rot`:
    only a head's first n_rot dims (partial RoPE, frequencies over n_rot), 0: all D."""
    t, h, d = x.shape
    rot = n_rot or d
    assert x.flags.c_contiguous and x.dtype == np.float32 and rot % 2 == 0 and rot <= d, (x.shape, rot)
    n_pairs = t * h * (rot // 2)
    if n_pairs:
        inv = _inv_freq(rot, float(base), x.device.id)
        _fn("rope_neox_inplace")(_blocks(n_pairs), (_THREADS,),
                                 (x, inv, np.int64(n_pairs), np.int32(h), np.int32(rot // 2), np.int64(pos0),
                                  _ptr(pos), np.int32(d)))
    return x


def kv_q4_encode(x: Any, q_out: Any = None, s_out: Any = None, pos: Any = None) -> tuple[Any, Any]:
    """x [T, H, D] float32 -> (packed uint8 [T, H, D/2], scale float16 [T, H, D/32]); writes
    into `q_out` / `s_out` (contiguous, e.g. the KV cache's cells) when given. With `pos`
    (int32 device array), `q_out` / `s_out` are a layer's cells from 0 and the rows land at
    cells pos[0].. (the token graph)."""
    import cupy

    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    t, h, d = x.shape
    q = q_out if q_out is not None else cupy.empty((t, h, d // 2), dtype=cupy.uint8)
    s = s_out if s_out is not None else cupy.empty((t, h, d // 32), dtype=cupy.float16)
    assert q.flags.c_contiguous and s.flags.c_contiguous
    assert q.size * 2 == s.size * 32 and (q.size * 2 == x.size or pos is not None), (q.shape, x.shape)
    n_blocks = x.size // 32
    if n_blocks:
        _fn("kv_q4_encode")(_blocks(n_blocks), (_THREADS,),
                            (x, q, s, np.int64(n_blocks), _ptr(pos), np.int64(h * d // 32)))
    return q, s


def kv_q4_decode(q: Any, s: Any, f16: bool = False) -> Any:
    """packed uint8 [n, H, D/2] and scale float16 [n, H, D/32] -> float32 [n, H, D], or
    (`f16`) float16: each value computed in float32 and rounded once."""
    import cupy

    n, h, half = q.shape
    out = cupy.empty((n, h, 2 * half), dtype=cupy.float16 if f16 else cupy.float32)
    assert q.flags.c_contiguous and s.flags.c_contiguous
    if q.size:
        name = "kv_q4_decode_f16" if f16 else "kv_q4_decode"
        _fn(name)(_blocks(q.size), (_THREADS,), (q, s, out, np.int64(q.size)))
    return out


def count_ids(ids: Any, n: int) -> Any:
    """ids: int64 values in [0, n) -> int32 [n], how many times each occurs."""
    import cupy

    flat = cupy.ascontiguousarray(ids, dtype=cupy.int64).reshape(-1)
    counts = cupy.zeros(n, dtype=cupy.int32)
    if flat.size:
        _fn("count_ids")(_blocks(flat.size), (_THREADS,), (flat, np.int32(flat.size), counts))
    return counts


def route_topk(logits: Any, routing: Any, bias: Any = None) -> tuple[Any, Any, Any]:
    """logits [T, E] float32 -> (ids [T, k] int64, weights [T, k] float32, margin [T]) as
    `routing` (`engine.backend.base.Routing`) says; `bias` float32 [E] or None."""
    import cupy

    logits = cupy.ascontiguousarray(logits, dtype=cupy.float32)
    t, e = logits.shape
    k = routing.k
    assert 0 < k <= min(e, 32) and e <= 1024, (k, e)
    if bias is not None:
        bias = cupy.ascontiguousarray(bias, dtype=cupy.float32)
        assert bias.shape == (e,), (bias.shape, e)
    ids = cupy.empty((t, k), dtype=cupy.int64)
    w = cupy.empty((t, k), dtype=cupy.float32)
    margin = cupy.empty(t, dtype=cupy.float32)
    if t:
        threads = min(_THREADS, max(32, -(-e // 32) * 32))
        _fn("route_topk")((t,), (threads,), (logits, ids, w, margin, np.int32(e), np.int32(k),
                                             _ptr(bias), np.int32(routing.sigmoid),
                                             np.int32(routing.norm), np.float32(routing.scale)))
    return ids, w, margin
