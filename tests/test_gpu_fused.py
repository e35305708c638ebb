"""The fused decode-step kernels (engine/kernels/fused.py) against their NumPy references.

GPU tests are marked `gpu` and skipped where CuPy is missing or finds no device; the source
and import checks run everywhere."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.backend import SimBackend
from engine.backend.array_ops import kv_encode, rms_norm, rope_neox
from engine.backend.base import Routing
from engine.kernels.fused import kernel_source
from engine.kv import KVCache
from engine.memory.sizes import MiB

RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def cuda(cp):  # type: ignore[no-untyped-def]
    """The CUDA backend, whose ops take these kernels."""
    from engine.backend.cuda import CudaBackend

    return CudaBackend(0)


def test_imports_without_cupy_and_finds_its_source() -> None:
    code = "import sys, engine.kernels.fused; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "route_topk" in kernel_source() and "kv_q4_encode" in kernel_source()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 2048), (3, 32, 128), (1, 64)])
@pytest.mark.parametrize("wdt", [np.float32, np.float16])
def test_rms_norm(cp, cuda, shape, wdt) -> None:  # type: ignore[no-untyped-def]
    x = RNG.standard_normal(shape).astype(np.float32) * 3
    w = (RNG.standard_normal(shape[-1]) * 0.5 + 1).astype(wdt)
    ref = rms_norm(np, x.astype(np.float64), w.astype(np.float64), 1e-6)
    out = cp.asnumpy(cuda.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6))  # the fused kernel
    assert out.dtype == np.float32 and out.shape == shape
    assert np.abs(out - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.mark.gpu
@pytest.mark.parametrize("pos0", [0, 1000])
def test_rope_in_place(cp, pos0: int) -> None:  # type: ignore[no-untyped-def]
    from engine.kernels.fused import rope_neox_

    x = RNG.standard_normal((7, 4, 128)).astype(np.float32)
    ref = rope_neox(np, x, np.arange(pos0, pos0 + 7), 1e6)  # the float32 reference
    dev = cp.asarray(x)
    out = rope_neox_(dev, pos0, 1e6)
    assert out is dev  # in place
    # the angle pos * inv_freq is one float32 product in both; cos/sin differ by an ulp or two
    assert np.abs(cp.asnumpy(out) - ref).max() < 1e-5 * (1 + pos0) ** 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("pos0", [0, 1000])
def test_partial_rope_rotates_the_first_dims_only(cp, pos0: int) -> None:  # type: ignore[no-untyped-def]
    """GLM's partial RoPE: 64 of a 128-dim head rotated (frequencies over 64), 64 untouched;
    the token graph's device position too."""
    from engine.kernels.fused import rope_neox_

    x = RNG.standard_normal((7, 4, 128)).astype(np.float32)
    ref = rope_neox(np, x, np.arange(pos0, pos0 + 7), 1e6, 64)
    out = cp.asnumpy(rope_neox_(cp.asarray(x), pos0, 1e6, n_rot=64))
    assert np.array_equal(out[..., 64:], x[..., 64:])
    assert np.abs(out - ref).max() < 1e-5 * (1 + pos0) ** 0.5
    at = cp.asnumpy(rope_neox_(cp.asarray(x), 0, 1e6, pos=cp.asarray([pos0], dtype=cp.int32), n_rot=64))
    assert np.array_equal(at, out)


@pytest.mark.gpu
def test_kv_q4_codec_matches_the_numpy_codec_exactly(cp, cuda) -> None:  # type: ignore[no-untyped-def]
    x = RNG.standard_normal((9, 4, 128)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0
    x[1, 1, 5] = -x[1, 1, :32].__abs__().max()  # equal magnitudes: the first wins
    host = KVCache(SimBackend(1 * MiB), 1, 16, 4, 128, "q4_0")
    q_ref, s_ref = kv_encode(np, "q4_0", x)
    dev = KVCache(cuda, 1, 16, 4, 128, "q4_0")
    dev.write(0, 3, cp.asarray(x), cp.asarray(x[::-1].copy()))
    assert np.array_equal(cp.asnumpy(dev.data[0, 0, 3:12]), q_ref)
    assert np.array_equal(cp.asnumpy(dev.scale[0, 0, 3:12]), s_ref)
    host.write(0, 3, x, x[::-1].copy())
    k_ref, v_ref = host.read(0, 12)
    k, v = dev.read(0, 12)
    assert np.array_equal(cp.asnumpy(k), k_ref) and np.array_equal(cp.asnumpy(v), v_ref)
    # a prompt chunk's read: the same values rounded once to fp16, what the flash kernel reads
    k16, v16 = dev.read(0, 12, chunk=True)
    assert k16.dtype == cp.float16 and np.array_equal(cp.asnumpy(k16), k_ref.astype(np.float16))
    assert np.array_equal(cp.asnumpy(v16), v_ref.astype(np.float16))


@pytest.mark.gpu
def test_f16_cells_are_read_in_place_for_a_chunk(cp, cuda) -> None:  # type: ignore[no-untyped-def]
    dev = KVCache(cuda, 2, 16, 4, 128, "f16")
    x = RNG.standard_normal((5, 4, 128)).astype(np.float32)
    dev.write(1, 0, cp.asarray(x), cp.asarray(x))
    k, _ = dev.read(1, 5, chunk=True)
    assert k.dtype == cp.float16 and k.data.ptr == dev.data[1, 0].data.ptr  # no copy
    assert np.array_equal(cp.asnumpy(k), x.astype(np.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("n_expert,k", [(128, 8), (16, 4), (8, 8)])
def test_route_topk(cp, cuda, n_expert: int, k: int) -> None:  # type: ignore[no-untyped-def]
    sim = SimBackend(1 * MiB)
    d = 64
    h = RNG.standard_normal((6, d)).astype(np.float32)
    router = RNG.standard_normal((n_expert, d)).astype(np.float32)
    router[3] = router[5]  # a tie in every row: the lower index comes first
    ids_r, w_r, m_r = sim.route(sim.linear(h, router), Routing(k))
    logits = cuda.linear(cp.asarray(h), cp.asarray(router))  # [6, E]
    ids, w, m = (cp.asnumpy(a) for a in cuda.route(logits, Routing(k)))
    assert ids.dtype == np.int64 and np.array_equal(ids, ids_r)
    assert np.abs(w - w_r).max() < 1e-6 and np.abs(m - m_r).max() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("n_expert,k,norm,scale", [(128, 8, True, 2.5), (160, 8, True, 1.0),
                                                   (8, 2, False, 1.0), (8, 8, True, 1.5)])
def test_sigmoid_route_with_a_selection_bias(cp, cuda, n_expert: int, k: int, norm: bool,
                                             scale: float) -> None:  # type: ignore[no-untyped-def]
    """glm4moe's routing: the top-k on sigmoid + bias, the weights the sigmoid itself."""
    sim = SimBackend(1 * MiB)
    logits = RNG.standard_normal((6, n_expert)).astype(np.float32)
    bias = (RNG.standard_normal(n_expert) * 0.2).astype(np.float32)
    rule = Routing(k, sigmoid=True, norm=norm, scale=scale)
    ids_r, w_r, m_r = sim.route(logits, rule, bias)
    ids, w, m = (cp.asnumpy(a) for a in cuda.route(cp.asarray(logits), rule, cp.asarray(bias)))
    assert np.array_equal(ids, ids_r)
    assert np.abs(w - w_r).max() < 1e-6 * scale and np.abs(m - m_r).max() < 1e-6
    assert not np.array_equal(ids_r, sim.route(logits, rule)[0])  # the bias changes the choice


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [0, 1, 9, 2_049, 131_072])
def test_expert_counts_are_bincount(cp, cuda, n_rows: int) -> None:  # type: ignore[no-untyped-def]
    """Rows per expert from ids on the device, every size one kernel: numpy's bincount."""
    ids = RNG.integers(0, 128, size=(n_rows, 8)).astype(np.int64)
    ids[: n_rows // 2] = 7  # a hot expert: many atomics on one counter
    got = cuda.expert_counts(cp.asarray(ids), 128)
    assert np.array_equal(got, np.bincount(ids.reshape(-1), minlength=128))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_linear_few_rows_take_the_fp16_gemv(cp, cuda, rows: int) -> None:  # type: ignore[no-untyped-def]
    x = RNG.standard_normal((rows, 256)).astype(np.float32)
    w = RNG.standard_normal((300, 256)).astype(np.float16)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    out = cp.asnumpy(cuda.linear(cp.asarray(x), cp.asarray(w)))
    assert out.dtype == np.float32 and out.shape == (rows, 300)
    # <= 8 rows: float32 products of the exact fp16 weights; 9 rows: x rounded to fp16 first
    bound = 1e-5 if rows <= 8 else 2e-3
    assert np.abs(out - ref).max() <= bound * np.abs(ref).max()
