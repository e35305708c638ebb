"""Microbenchmarks of the CUDA pieces; prints a table and writes it to `--out DIR/bench.md`.

    python -m engine.tools.kernel_bench --out DIR [--quick]

Rows: device-to-device copy (the bandwidth ceiling, bytes read + written), host-to-device
upload (pageable through the pinned staging buffer, and pinned directly), fused
dequantize-GEMV per quant type (weight bytes / time, B = 1 and 8), dequantize to fp16, the
grouped MoE prefill (GFLOP/s of its three GEMMs) and the prompt-path causal attention, cuBLAS
and fused flash, FA2 and (on compute capability 9.0) sm_90a (TFLOP/s on visible keys). Times
are medians of CUDA-event timings after warm-up; inputs are random valid blocks
(`random_quant_bytes`), never zeros.
`--only attention` runs the attention rows alone; `--only moe` the grouped MoE prefill at the
benchmark's chunk sizes (Q4_0 experts of Qwen3-30B-A3B), with its GEMMs timed alone.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.gguf.quant import ExpertLayout
from engine.synth.blocks import set_scales

GB = 1e9
GEMV_TYPES = (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_XXS, Q.F16, Q.Q2_K, Q.Q3_K,
              Q.IQ2_XXS, Q.IQ2_S, Q.IQ3_S, Q.IQ1_M, Q.IQ4_NL, Q.MXFP4)


def random_quant_bytes(
    rng: np.random.Generator, qtype: Q, shape: tuple[int, int], std: float = 0.05
) -> np.ndarray:
    """uint8 [rows * row_bytes]: random valid blocks whose f16 scale fields vary per block,
    scaled so the decoded values have about `std` standard deviation."""
    n_rows, n_cols = shape
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if qtype == Q.F32:
            return x.reshape(-1).view(np.uint8)
        if qtype == Q.F16:
            return x.astype(np.float16).reshape(-1).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).reshape(-1).view(np.uint8)
    n_blocks = n_rows * n_cols // block
    raw = rng.integers(0, 256, size=(n_blocks, type_bytes), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.5, n_blocks)
    probe = min(n_blocks, 64)
    for gain in (1.0, None):  # decoded values are linear in the scale fields: measure, rescale
        if gain is None:
            gain = std / float(gq.dequantize(raw[:probe], qtype).std())
        set_scales(raw, qtype, scales * gain)
    return raw.reshape(-1)


def time_ms(fn: Any, *, warmup: int = 3, repeat: int = 20) -> float:
    """Median milliseconds of `fn()` on the current stream, timed with CUDA events."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def bench_copies(backend: Any, n_bytes: int) -> list[tuple[str, str, float, str]]:
    import cupy as cp

    rows = []
    a = cp.empty(n_bytes // 4, dtype=cp.float32)
    a[:] = 1.5
    b = cp.empty_like(a)
    ms = time_ms(lambda: cp.copyto(b, a))
    rows.append(("d2d copy", f"{n_bytes >> 20} MiB", 2 * n_bytes / ms / 1e6, "GB/s (read+write)"))
    dev = cp.empty(n_bytes, dtype=cp.uint8)
    host = np.random.default_rng(0).integers(0, 256, n_bytes, dtype=np.uint8)
    pinned = backend.host_buffer(n_bytes)
    pinned[:] = host
    for name, src in (("h2d pageable (staged)", host), ("h2d pinned", pinned)):
        backend.upload(src, dev)
        backend.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            backend.upload(src, dev)
            backend.synchronize()
            times.append(time.perf_counter() - t0)
        gbs = n_bytes / statistics.median(times) / GB
        rows.append((name, f"{n_bytes >> 20} MiB", gbs, "GB/s"))
    assert cp.array_equal(dev[:4096], cp.asarray(host[:4096])), "upload corrupted data"
    return rows


def bench_gemv(shape: tuple[int, int], quick: bool) -> list[tuple[str, str, float, str]]:
    import cupy as cp

    from engine.kernels.dequant import dequantize_many, gemv

    rng = np.random.default_rng(1)
    rows = []
    n_out, n_in = shape
    for qtype in GEMV_TYPES[:3] if quick else GEMV_TYPES:
        w = cp.asarray(random_quant_bytes(rng, qtype, shape))
        for n_batch in (1, 8):
            x = cp.asarray(rng.standard_normal((n_batch, n_in), dtype=np.float32))
            y = cp.empty((n_batch, n_out), dtype=cp.float32)
            ms = time_ms(functools.partial(gemv, w, qtype, shape, x, out=y))
            label = f"gemv {qtype.name} B={n_batch}"
            rows.append(
                (label, f"{n_out}x{n_in}, {w.nbytes >> 20} MiB", w.nbytes / ms / 1e6, "GB/s")
            )
        out = cp.empty(shape, dtype=cp.float16)
        ms = time_ms(functools.partial(dequantize_many, [w], qtype, shape, [out]))
        moved = w.nbytes + out.nbytes
        rows.append(
            (f"dequant {qtype.name} -> f16", f"{n_out}x{n_in}", moved / ms / 1e6, "GB/s (r+w)")
        )
    w = cp.asarray(random_quant_bytes(rng, Q.Q4_K, shape))
    x = cp.asarray(rng.standard_normal(n_in, dtype=np.float32))
    for rows_per_warp in (1, 2, 4):
        call = functools.partial(gemv, w, Q.Q4_K, shape, x, rows_per_warp=rows_per_warp)
        ms = time_ms(call)
        rows.append(
            (f"gemv Q4_K B=1 R={rows_per_warp}", f"{n_out}x{n_in}", w.nbytes / ms / 1e6, "GB/s")
        )
    small = (768, 2048)
    w = cp.asarray(random_quant_bytes(rng, Q.Q4_K, small))
    x = cp.asarray(rng.standard_normal(small[1], dtype=np.float32))
    ms = time_ms(lambda: gemv(w, Q.Q4_K, small, x))
    rows.append(("gemv Q4_K expert-sized", "768x2048", ms * 1000, "us per call"))
    return rows


def bench_moe(
    n_tokens: int, n_expert: int, k: int, d: int, f: int,
    qtypes: tuple[Q, Q, Q] = (Q.Q4_K, Q.Q4_K, Q.Q6_K), decode_rows: bool = True,
) -> list[tuple[str, str, float, str]]:  # fmt: skip
    """`moe_prefill` of one layer (and, beside it, its two GEMMs alone on one scratch group of
    the same shapes, the fp16 decode of every expert, and `moe_decode` unless not
    `decode_rows`) with random valid expert bytes and uniform random routing; timed with the
    routing's row counts read as the prompt path reads them."""
    import cupy as cp

    from engine.kernels.moe import (
        DEFAULT_SCRATCH_BYTES,
        _decode_group,
        expert_fp16_bytes,
        gemm_nt,
        moe_decode,
        moe_prefill,
    )

    rng = np.random.default_rng(2)
    layout = ExpertLayout(qtypes, ((f, d), (f, d), (d, f)))
    blobs = {}
    for e in range(n_expert):
        parts = [random_quant_bytes(rng, q, s) for q, s in zip(layout.qtypes, layout.shapes)]
        blobs[e] = cp.asarray(np.concatenate(parts))
    h = cp.asarray(rng.standard_normal((n_tokens, d), dtype=np.float32))
    ids = cp.asarray(np.argsort(rng.random((n_tokens, n_expert)), axis=1)[:, :k].astype(np.int32))
    w = cp.asarray(rng.random((n_tokens, k), dtype=np.float32))

    def run() -> Any:  # as the prompt path calls it: moe_block reads the row counts once
        counts = cp.bincount(ids.reshape(-1), minlength=n_expert).get()
        return moe_prefill(h, ids, w, blobs, layout, counts=counts)

    ms = time_ms(run, warmup=2, repeat=7)
    flops = 6.0 * n_tokens * k * d * f
    label = f"moe prefill T={n_tokens} E={n_expert} k={k}"
    types = "/".join(q.name for q in qtypes)
    rows = [
        (label, f"d={d} f={f} {types}", flops / ms / 1e6, "GFLOP/s"),
        (label, "time per layer", ms, "ms"),
        (label, "tokens per second per layer", n_tokens / ms * 1000, "tok/s"),
    ]
    # the GEMMs alone: one scratch group of experts, each with its mean row count
    n_g = min(n_expert, DEFAULT_SCRATCH_BYTES // expert_fp16_bytes(layout))
    m = max(1, n_tokens * k // n_expert)
    a = cp.asarray(rng.standard_normal((n_g, m, d), dtype=np.float32), dtype=cp.float16)
    wgu_g = cp.asarray(rng.standard_normal((n_g, 2 * f, d), dtype=np.float32) * 0.02, dtype=cp.float16)
    wd_g = cp.asarray(rng.standard_normal((n_g, d, f), dtype=np.float32) * 0.02, dtype=cp.float16)
    gu = cp.empty((n_g, m, 2 * f), dtype=cp.float16)
    act = cp.zeros((n_g, m, f), dtype=cp.float16)
    y = cp.empty((n_g, m, d), dtype=cp.float16)
    ms = time_ms(lambda: (gemm_nt(a, wgu_g, gu), gemm_nt(act, wd_g, y)), warmup=2, repeat=7)
    rows.append((f"moe GEMMs alone: {n_g} experts x {m} rows", "gate|up + down, fp16",
                 6.0 * n_g * m * d * f / ms / 1e9, "TFLOP/s"))
    wgu = cp.empty((n_expert, 2 * f, d), dtype=cp.float16)
    wd = cp.empty((n_expert, d, f), dtype=cp.float16)
    members = [blobs[e] for e in range(n_expert)]
    ms = time_ms(lambda: _decode_group(members, layout, wgu, wd), warmup=2, repeat=7)
    rows.append(
        (
            f"moe decode-to-f16 of {n_expert} experts",
            f"{wgu.nbytes + wd.nbytes >> 20} MiB out",
            ms,
            "ms",
        )
    )
    for n_tok in (1, 4) if decode_rows else ():
        hd, idd, wdd = h[:n_tok], ids[:n_tok].get(), w[:n_tok]  # ids read once, as moe_block does
        call = functools.partial(moe_decode, hd, idd, wdd, blobs, layout)
        ms = time_ms(call, warmup=2, repeat=20)
        moved = n_tok * k * layout.blob_bytes
        rows.append(
            (
                f"moe decode B={n_tok} k={k}",
                f"{moved >> 20} MiB of experts",
                ms * 1000,
                "us per layer",
            )
        )
    return rows


def bench_attention(
    cases: tuple[tuple[int, int], ...] = ((4096, 0), (4096, 27162)),
    n_head: int = 32,
    n_kv: int = 4,
    d: int = 128,
) -> list[tuple[str, str, float, str]]:
    """`causal_attention` and the fused flash kernels for (T, pos0) prompt chunks with
    Qwen3-30B-A3B heads: FA2 (`mma.sync`) always, and the sm_90a one (`wgmma`) where the device
    runs it, with its largest difference from FA2 in parts per million of max |FA2 out| (the
    two round alike and differ in summation order and tile size: a few hundred ppm; a layout or
    masking bug shows as tens of thousands). TFLOP/s counts only visible keys (`causal_flops`:
    4 * H * D * sum of the keys each query sees). The float32 `causal_gqa` on CuPy (the path
    they replace) is timed beside them."""
    import cupy as cp

    from engine.backend.array_ops import causal_gqa
    from engine.kernels.attention import causal_attention, causal_flops
    from engine.kernels.flash import (
        SM90_HEAD_SIZES,
        flash_attention_fa2,
        flash_attention_sm90a,
        sm90a_available,
    )

    rng = np.random.default_rng(3)
    rows = []
    for t, pos0 in cases:
        s = pos0 + t
        q = cp.asarray(rng.standard_normal((t, n_head, d), dtype=np.float32))
        k = cp.asarray(rng.standard_normal((s, n_kv, d), dtype=np.float32))
        v = cp.asarray(rng.standard_normal((s, n_kv, d), dtype=np.float32))
        ms = time_ms(functools.partial(causal_attention, q, k, v, pos0), warmup=2, repeat=7)
        label = f"attention T={t} pos0={pos0}"
        size = f"H={n_head} Hkv={n_kv} D={d}"
        rows.append((label, size, causal_flops(t, pos0, n_head, d) / ms / 1e9, "TFLOP/s"))
        rows.append((label, "time per layer", ms, "ms"))
        kernels = [("flash FA2 (mma.sync)", flash_attention_fa2)]
        if d in SM90_HEAD_SIZES and sm90a_available():
            kernels.append(("flash sm_90a (wgmma)", flash_attention_sm90a))
        for name, attend in kernels:
            ms = time_ms(functools.partial(attend, q, k, v, pos0), warmup=2, repeat=7)
            rows.append((f"{name} {label}", size, causal_flops(t, pos0, n_head, d) / ms / 1e9,
                         "TFLOP/s"))  # fmt: skip
            rows.append((f"{name} {label}", "time per layer", ms, "ms"))
        if len(kernels) == 2:
            fa2, sm90 = flash_attention_fa2(q, k, v, pos0), flash_attention_sm90a(q, k, v, pos0)
            ppm = 1e6 * float(cp.abs(sm90 - fa2).max() / cp.abs(fa2).max())
            rows.append((f"flash sm_90a vs FA2 {label}", "max |diff|", ppm, "ppm of max |FA2|"))
            del fa2, sm90
        if t * (pos0 + t) <= 4096 * 31258:  # the float32 reference takes seconds past that
            ms = time_ms(functools.partial(causal_gqa, cp, q, k, v, pos0), warmup=1, repeat=3)
            rows.append((label, "before: causal_gqa float32", ms, "ms"))
    return rows


def format_table(rows: list[tuple[str, str, float, str]], device: str) -> str:
    lines = [f"device: {device}", "", "| what | size | value | unit |", "|---|---|---:|---|"]
    lines += [f"| {a} | {b} | {v:,.1f} | {u} |" for a, b, v, u in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write bench.md here")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer types")
    parser.add_argument("--only", choices=["attention", "moe"], help="one group of rows")
    args = parser.parse_args(argv)
    import cupy as cp

    from engine.backend.cuda import CudaBackend

    backend = CudaBackend(0)
    props = cp.cuda.runtime.getDeviceProperties(0)
    device = f"{props['name'].decode()} (sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs)"
    rows = []
    if args.only is None:
        rows += bench_copies(backend, (256 if args.quick else 1024) << 20)
        rows += bench_gemv((8192, 4096) if args.quick else (32768, 8192), args.quick)
        rows += bench_moe(512, 32, 8, 2048, 768) if args.quick else bench_moe(2048, 128, 8, 2048, 768)
    if args.only == "moe":  # the benchmark's chunks: 8,704 (loan off) and 16,384 (on) at 31k
        for t in (2048, 8704, 16384):
            rows += bench_moe(t, 128, 8, 2048, 768, (Q.Q4_0, Q.Q4_0, Q.Q4_0), decode_rows=False)
    if args.only in (None, "attention"):
        rows += bench_attention(((4096, 0), (4096, 27162), (16384, 14874), (8192, 63869)))
    table = format_table(rows, device)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
