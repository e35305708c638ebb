"""Fused flash attention on CUDA (`engine.kernels.flash`) against numpy `causal_gqa` and the
cuBLAS path (`engine.kernels.attention.causal_attention`). Skipped where CuPy finds no device.

Every attention test runs once per kernel (the `kernel` fixture), through `flash_attention`'s
dispatch: "fa2" everywhere (STRATA_FLASH=fa2), "sm90a" where the device runs it (compute
capability 9.0, NVRTC 13+) and the head size is one it takes. `test_wgmma_building_blocks`
checks the sm90a kernel's GEMMs alone, exactly, so that a layout bug shows where it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.backend.array_ops import causal_gqa

pytestmark = pytest.mark.gpu

# Tolerance against the float64 reference, as max |error| / max |reference|. The kernel rounds
# q, k, v and the probabilities P to fp16 (relative error <= 2^-11 ~ 4.9e-4 each) and does all
# else in fp32 (scores, max, sums, the P V accumulation): unlike the cuBLAS path, scores are
# never stored in fp16. With scores of std ~2 (q std 2), the q/k rounding moves a score by
# ~8e-4 (std), the probabilities by that fraction, and the output (a convex combination of v
# rows) by that times |v|, plus the v and P roundings; signs scatter. A float64 model of these
# roundings on the inputs of test_matches_numpy_and_cublas gives 3e-4 .. 1.4e-3 (the worst:
# D=16, T=17, pos0=257; a NumPy emulation of the kernel's fragments gives the same 1.4e-3
# there), so 3e-3 leaves a 2x margin, while a wrong mask, row mapping or fragment layout errs
# by far more (one key more or fewer per query after a 257-key prefix already moves the output
# by 0.1 .. 0.4 of max |out|: these scores are peaked).
REL_TOL = 3e-3
# Against the cuBLAS path: its own bound (1e-2, tests/test_gpu_attention.py: it stores the
# scores in fp16) plus ours.
REL_TOL_CUBLAS = 1e-2 + REL_TOL
# Against a reference on the fp16-rounded inputs only P's rounding and fp32 arithmetic remain
# (emulation: ~1e-4).
REL_TOL_ROUNDED_INPUTS = 1e-3


@pytest.fixture(params=["fa2", "sm90a"])
def kernel(request: pytest.FixtureRequest, cp: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """The flash kernel under test, chosen through STRATA_FLASH; "sm90a" is skipped where the
    device cannot run it."""
    from engine.kernels import flash

    if request.param == "fa2":
        monkeypatch.setenv(flash.ENV, "fa2")
    else:
        monkeypatch.delenv(flash.ENV, raising=False)
        if not flash.sm90a_available():
            pytest.skip("the sm90a kernel needs compute capability 9.0 and NVRTC 13+")
    return request.param


def _expect(kernel: str, d: int) -> None:
    """Skips head sizes the kernel does not take; checks that the dispatch picks the kernel."""
    from engine.kernels import flash

    if kernel == "sm90a" and d not in flash.SM90_HEAD_SIZES:
        pytest.skip(f"the sm90a kernel does not take D={d}")
    assert flash.kernel_for(d) == kernel


def _inputs(
    t: int, pos0: int, n_head: int, n_kv: int, d: int, extra: int = 0, q_std: float = 2.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [T, H, D] (std q_std), k, v [pos0 + T + extra, Hkv, D] (std 1), float32."""
    rng = np.random.default_rng(7 * t + 13 * pos0 + n_head + d)
    s = pos0 + t + extra
    q = (rng.standard_normal((t, n_head, d)) * q_std).astype(np.float32)
    k = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    return q, k, v


def _ref(q: Any, k: Any, v: Any, pos0: int, xp: Any = np) -> Any:
    """causal_gqa in float64 over keys 0..pos0+T-1 (xp: numpy, or cupy for large cases)."""
    s = pos0 + q.shape[0]
    return causal_gqa(xp, *(xp.asarray(x).astype(xp.float64) for x in (q, k[:s], v[:s])), pos0)


def _rel(got: Any, want: Any, xp: Any = np) -> float:
    return float(xp.abs(got - want).max() / xp.abs(want).max())


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize(
    "n_head, n_kv", [(4, 4), (8, 4), (16, 2), (32, 4)], ids=["G1", "G2", "G8", "G8-H32"]
)
@pytest.mark.parametrize("pos0", [0, 257])
@pytest.mark.parametrize("t", [1, 17, 100, 300])
def test_matches_numpy_and_cublas(
    cp, kernel: str, d: int, n_head: int, n_kv: int, pos0: int, t: int
) -> None:
    """T*G rows: from 1 (T = 1) to several row tiles, never a multiple of 64, so the last row
    tile is part-filled; S' = pos0 + T keys: one key tile or several, never a multiple of 8 (the
    sm90a kernel pads its V^T rows to 8 keys)."""
    from engine.kernels.attention import causal_attention
    from engine.kernels.flash import flash_attention

    _expect(kernel, d)
    q, k, v = _inputs(t, pos0, n_head, n_kv, d)
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    got = flash_attention(qd, kd, vd, pos0)
    assert got.dtype == cp.float32 and got.shape == (t, n_head, d)
    got = got.get()
    assert np.isfinite(got).all()
    err = _rel(got, _ref(q, k, v, pos0))
    assert err < REL_TOL, f"relative error {err:.2e} vs float64 numpy"
    err = _rel(got, causal_attention(qd, kd, vd, pos0).get())
    assert err < REL_TOL_CUBLAS, f"relative difference {err:.2e} vs the cuBLAS path"


@pytest.mark.parametrize(
    "t, pos0, n_head, n_kv, d, dtype",
    [
        (70, 30, 6, 2, 32, np.float32),  # G = 3: a block's rows split unevenly over queries
        (45, 100, 8, 2, 256, np.float32),  # D = 256: 32-key tiles
        (130, 65, 8, 2, 128, np.float16),  # fp16 q, k, v
    ],
    ids=["G3-D32", "D256", "f16-inputs"],
)
def test_other_shapes_and_dtypes(
    cp, kernel: str, t: int, pos0: int, n_head: int, n_kv: int, d: int, dtype: type
) -> None:
    from engine.kernels.flash import flash_attention

    _expect(kernel, d)
    q, k, v = (x.astype(dtype) for x in _inputs(t, pos0, n_head, n_kv, d))
    got = flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0).get()
    err = _rel(got, _ref(q, k, v, pos0))
    assert err < REL_TOL, f"relative error {err:.2e}"


def test_qwen3_30b_a3b_chunk(cp, kernel: str) -> None:
    """H=32, Hkv=4, D=128: a 1024-query chunk after 3000 cached positions (the float64
    reference runs on the GPU)."""
    from engine.kernels.attention import causal_attention
    from engine.kernels.flash import flash_attention

    _expect(kernel, 128)
    t, pos0 = 1024, 3000
    q, k, v = (cp.asarray(x) for x in _inputs(t, pos0, 32, 4, 128))
    got = flash_attention(q, k, v, pos0)
    ref = _ref(q, k, v, pos0, xp=cp)
    err = _rel(got, ref, xp=cp)
    assert err < REL_TOL, f"relative error {err:.2e} vs float64"
    err = float(cp.abs(got - causal_attention(q, k, v, pos0)).max() / cp.abs(ref).max())
    assert err < REL_TOL_CUBLAS, f"relative difference {err:.2e} vs the cuBLAS path"


def test_keys_past_the_chunk_are_ignored(cp, kernel: str) -> None:
    """k, v hold S > pos0 + T positions; the extra ones (NaN here) must not be read."""
    from engine.kernels.flash import flash_attention

    _expect(kernel, 64)
    t, pos0 = 90, 40
    s = pos0 + t
    q, k, v = _inputs(t, pos0, 8, 2, 64, extra=77)
    k[s:] = np.nan
    v[s:] = np.nan
    got = flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0).get()
    exact = flash_attention(cp.asarray(q), cp.asarray(k[:s]), cp.asarray(v[:s]), pos0).get()
    np.testing.assert_array_equal(got, exact)
    assert _rel(got, _ref(q, k, v, pos0)) < REL_TOL


def test_first_query_sees_only_the_first_key(cp, kernel: str) -> None:
    """pos0 = 0 with large scores (masked future keys would dominate): query 0's softmax is
    exactly [1, 0, ...], so its output is v[0] rounded to fp16, bit for bit; every row is finite
    (each query sees at least key 0: no row is empty)."""
    from engine.kernels.flash import flash_attention

    t, h, hkv, d = 100, 8, 2, 128
    _expect(kernel, d)
    q, k, v = _inputs(t, 0, h, hkv, d, q_std=8.0)
    got = flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), 0).get()
    assert np.isfinite(got).all()
    v0 = v[0].astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got[0], np.repeat(v0, h // hkv, axis=0))  # head j: kv j // G
    # near one-hot rows amplify the q, k rounding: compare against the rounded inputs
    err = _rel(got, _ref(*(x.astype(np.float16) for x in (q, k, v)), 0))
    assert err < REL_TOL_ROUNDED_INPUTS, f"relative error {err:.2e} vs fp16-rounded inputs"


def test_empty_chunk_and_head_sizes(cp, kernel: str) -> None:
    from engine.kernels.flash import flash_attention, supported

    _expect(kernel, 64)
    q = cp.zeros((0, 4, 64), dtype=cp.float32)
    kv = cp.zeros((10, 2, 64), dtype=cp.float32)
    assert flash_attention(q, kv, kv, 10).shape == (0, 4, 64)
    assert all(supported(d) for d in range(16, 257, 16))
    assert not any(supported(d) for d in (0, 8, 24, 100, 272))


def test_dispatch(cp, monkeypatch: pytest.MonkeyPatch) -> None:
    """STRATA_FLASH=fa2 forces the FA2 kernel; other head sizes always get it; a typo fails."""
    from engine.kernels import flash

    monkeypatch.setenv(flash.ENV, "fa2")
    assert flash.kernel_for(128) == "fa2"
    monkeypatch.setenv(flash.ENV, "fa3")
    with pytest.raises(ValueError, match="STRATA_FLASH"):
        flash.kernel_for(128)
    monkeypatch.delenv(flash.ENV)
    assert flash.kernel_for(32) == "fa2"
    want = "sm90a" if flash.sm90a_available() else "fa2"
    assert flash.kernel_for(128) == flash.kernel_for(64) == want


@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_building_blocks(cp, d: int) -> None:
    """The sm90a kernel's two GEMMs alone (`flash.wgmma_gemm_test`: load_tile's swizzled
    shared memory, the wgmma descriptors, the accumulator and A-from-registers fragments):
    s = q k^T [64, 128] and o = fp16(s) v [64, D] on small integers, where fp32 and fp16 are
    exact, so both must match bit for bit. A wrong swizzle, descriptor field or fragment
    mapping moves or mixes entries: the message names the first wrong (row, col)."""
    from engine.kernels import flash

    if not flash.sm90a_available():
        pytest.skip("the sm90a kernel needs compute capability 9.0 and NVRTC 13+")
    rng = np.random.default_rng(d)
    # |s| <= 2 * 2 * D <= 512 and |o| <= 512 * 2 * 128: integers, exact in fp16 / fp32
    shapes = ((64, d), (128, d), (128, d))
    q, k, v = (rng.integers(-2, 3, shape).astype(np.float16) for shape in shapes)
    s, o = flash.wgmma_gemm_test(cp.asarray(q), cp.asarray(k), cp.asarray(v.T))
    s, o = s.get(), o.get()
    want_s = q.astype(np.float64) @ k.astype(np.float64).T
    want_o = want_s @ v.astype(np.float64)
    for name, got, want in (("s = q k^T", s, want_s), ("o = s v", o, want_o)):
        wrong = np.argwhere(got != want)
        assert len(wrong) == 0, (
            f"{name}: {len(wrong)} of {want.size} entries wrong, first at (row, col) "
            f"{tuple(wrong[0])}: {got[tuple(wrong[0])]} instead of {want[tuple(wrong[0])]}"
        )
