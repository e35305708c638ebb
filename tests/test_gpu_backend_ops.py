"""The CUDA backend's ops (engine/backend/cuda_ops.py: a kernel where one applies, array code on
CuPy where none does) against the simulated device's array ops on the same inputs: every branch
of the dispatch, and a model run on both backends with the CUDA decode step's copies counted.

Marked `gpu`; skipped where CuPy is missing or finds no device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.backend import SimBackend
from engine.backend.base import CopyCounts, Routing
from engine.gguf.quant import ExpertLayout, row_bytes
from engine.kv import KVCache
from engine.memory.sizes import MiB
from engine.model.loader import load_model
from engine.request.session import Session
from engine.tools.kernel_bench import random_quant_bytes

pytestmark = pytest.mark.gpu
RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def cuda(cp):  # type: ignore[no-untyped-def]
    from engine.backend.cuda import CudaBackend

    return CudaBackend(0)


@pytest.fixture(scope="module")
def sim() -> SimBackend:
    return SimBackend(256 * MiB)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize(("rows", "wdt", "tol"), [
    (1, np.float16, 1e-5), (8, np.float16, 1e-5),  # the fused fp16 GEMV: fp32 products
    (9, np.float16, 2e-3), (64, np.float16, 2e-3),  # cuBLAS on x rounded to fp16
    (3, np.float32, 1e-5),  # float32 weights: cuBLAS in float32
])  # fmt: skip
def test_linear(cp, cuda, rows: int, wdt: type, tol: float) -> None:  # type: ignore[no-untyped-def]
    x = RNG.standard_normal((rows, 256)).astype(np.float32)
    w = RNG.standard_normal((300, 256)).astype(wdt)
    got = cuda.download(cuda.linear(cp.asarray(x), cp.asarray(w)))
    assert got.dtype == np.float32 and got.shape == (rows, 300)
    assert rel_err(got, x.astype(np.float64) @ w.astype(np.float64).T) <= tol


def test_norm_rope_and_route(cp, cuda, sim) -> None:  # type: ignore[no-untyped-def]
    x = RNG.standard_normal((5, 4, 128)).astype(np.float32) * 3
    w = (RNG.standard_normal(128) * 0.5 + 1).astype(np.float32)
    got = cuda.download(cuda.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6))  # the fused kernel
    assert rel_err(got, sim.rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-6)) <= 2e-6
    rotated = cuda.download(cuda.rope(cp.asarray(x), 1000, 1e6))  # in place, fused
    assert np.abs(rotated - sim.rope(x, 1000, 1e6)).max() < 1e-5 * 1001**0.5 * 3
    logits = RNG.standard_normal((6, 16)).astype(np.float32)
    logits[:, 5] = logits[:, 3]  # a tie in every row: the lower index comes first
    ids, wts, margin = (cuda.download(a) for a in cuda.route(cp.asarray(logits), Routing(4)))
    ids_r, wts_r, margin_r = sim.route(logits, Routing(4))
    assert np.array_equal(ids, ids_r) and np.abs(wts - wts_r).max() < 1e-6
    assert np.abs(margin - margin_r).max() < 1e-6


@pytest.mark.parametrize(("t", "pos0", "d", "tol"), [
    (1, 37, 128, 1e-5),  # a decode row: the array code on CuPy
    (40, 10, 128, 3e-3),  # a prompt chunk: the flash kernel
    (40, 10, 72, 1.3e-2),  # a head size flash does not take: cuBLAS GEMMs + fused softmax
])  # fmt: skip
def test_attention(cp, cuda, sim, t: int, pos0: int, d: int, tol: float) -> None:  # type: ignore[no-untyped-def]
    q = RNG.standard_normal((t, 8, d)).astype(np.float32)
    k, v = (RNG.standard_normal((pos0 + t, 2, d)).astype(np.float32) for _ in range(2))
    got = cuda.download(cuda.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0))
    want = sim.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), pos0)
    assert got.shape == (t, 8, d) and rel_err(got, want) <= tol


@pytest.mark.parametrize("kind", ["f16", "int8", "q4_0"])
def test_kv_codec_is_bit_identical(cp, cuda, sim, kind: str) -> None:  # type: ignore[no-untyped-def]
    x = RNG.standard_normal((9, 2, 64)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block
    host, dev = KVCache(sim, 1, 16, 2, 64, kind), KVCache(cuda, 1, 16, 2, 64, kind)
    host.write(0, 3, x, -x)
    dev.write(0, 3, cp.asarray(x), cp.asarray(-x))  # q4_0: the fused encode, else array code
    assert np.array_equal(cuda.download(dev.data), host.data)
    if host.scale is not None:
        assert np.array_equal(cuda.download(dev.scale), host.scale)
    for a, b in zip(dev.read(0, 12), host.read(0, 12)):
        assert np.array_equal(cuda.download(a), b)


@pytest.mark.parametrize("n_rows", [3, 20])  # on the host, then decoded on the device
def test_embed_counts_its_upload(cp, cuda, sim, n_rows: int) -> None:  # type: ignore[no-untyped-def]
    d = 256
    table = random_quant_bytes(RNG, Q.Q8_0, (50, d)).reshape(50, row_bytes(Q.Q8_0, d))
    rows = table[RNG.integers(0, 50, n_rows)]  # [T, row_bytes]
    before = cuda.stats.snapshot()
    got = cuda.download(cuda.embed(rows, Q.Q8_0, d))
    up = (cuda.stats.snapshot() - before).h2d_bytes
    assert up == (rows.nbytes if n_rows > 8 else n_rows * d * 4)
    assert rel_err(got, sim.embed(rows, Q.Q8_0, d)) <= 1e-6


def test_decode_expert(cp, cuda, sim) -> None:  # type: ignore[no-untyped-def]
    f, d = 256, 256  # K-quant rows are multiples of 256 values
    layout = ExpertLayout((Q.Q8_0, Q.Q4_K, Q.Q6_K), ((f, d), (f, d), (d, f)))
    parts = [random_quant_bytes(RNG, q, s) for q, s in zip(layout.qtypes, layout.shapes)]
    blob = np.concatenate(parts)  # gate | up | down, as a cache slot holds them
    pairs = zip(cuda.decode_expert(cp.asarray(blob), layout), sim.decode_expert(blob, layout))
    for got, want in pairs:
        assert got.shape == want.shape and rel_err(cuda.download(got), want) <= 1e-6


def test_copies_marks_and_the_chunk_arena(cp, cuda) -> None:  # type: ignore[no-untyped-def]
    host = RNG.standard_normal((10, 3)).astype(np.float32)
    before = cuda.stats.snapshot()
    dev = cuda.to_device(host)
    assert cuda.as_device(dev) is dev
    again = cuda.as_device(host)  # a host array: copied, counted
    cuda.upload_inline(host[::-1].copy(), again)
    assert np.array_equal(cuda.download(again), host[::-1])
    assert np.array_equal(cuda.download(dev), host)
    assert cuda.stats.snapshot() - before == CopyCounts(3 * host.nbytes, 3, 2 * host.nbytes, 2)
    start = cuda.time_mark()
    cp.ones(1 << 20, dtype=cp.float32).sum()
    assert cuda.seconds_between(start, cuda.time_mark()) >= 0
    buf = cp.empty(8 * MiB, dtype=cp.uint8)
    arena = cuda.chunk_arena(buf)
    with arena:
        tmp = cp.ones(1 << 18, dtype=cp.float32)  # 1 MiB from the chunk buffer
        assert buf.data.ptr <= tmp.data.ptr < buf.data.ptr + buf.nbytes
        del tmp
    arena.close()
    assert arena.peak_bytes >= 1 << 20 and arena.spilled_bytes == 0


def test_a_model_runs_alike_on_both_backends_and_cuda_counts_its_copies(
    cp, cuda, sim, tiny_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A prompt (the prompt kernels: flash attention, grouped MoE on uploaded expert bytes) and
    three decode steps (GEMV MoE); each step's copies on CUDA, from the shapes: its embedding
    row and each layer's k expert blobs up, each layer's routed ids and the logits row down."""
    rows, counts = {}, {}
    for name, be in (("sim", sim), ("cuda", cuda)):
        model = load_model(tiny_path, be)
        session = Session(model, n_ctx=128)
        logits = session.prefill(list(range(5, 45)), 64)  # [1, V]
        out = [be.download(logits[-1])]
        before = be.stats.snapshot()
        for tok in (7, 8, 9):
            out.append(be.download(session.forward([tok]).logits[-1]))
        rows[name], counts[name] = np.stack(out), be.stats.snapshot() - before
    assert rel_err(rows["cuda"], rows["sim"]) < 0.03  # fp16 prompt GEMMs and attention
    hp = model.hp
    blob = model.experts.blob_bytes
    n_down = 3 * (hp.n_vocab * 4 + hp.n_layer * hp.n_expert_used * 8)
    assert counts["cuda"] == CopyCounts(
        h2d_bytes=3 * (hp.n_embd * 4 + hp.n_layer * hp.n_expert_used * blob),
        h2d_copies=3 * (1 + hp.n_layer * hp.n_expert_used),
        d2h_bytes=n_down, d2h_copies=3 * (1 + hp.n_layer),
    )  # fmt: skip
    assert (counts["sim"].d2h_bytes, counts["sim"].d2h_copies) == (n_down, 3 * (1 + hp.n_layer))
