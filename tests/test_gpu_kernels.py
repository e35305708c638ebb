"""CUDA kernels against the CPU references: `gguf.quants` decoding and numpy float64 math.

GPU tests are marked `gpu` and skipped where CuPy is missing or finds no device; the layout and
import checks run everywhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.gguf.quant import ExpertLayout, dequantize_bytes
from engine.kernels.dequant import SUPPORTED, check_layouts, kernel_source, lookup_table
from engine.tools.kernel_bench import random_quant_bytes


def _ref(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    return dequantize_bytes(raw, qtype, shape).astype(np.float64)


# -- everywhere -----------------------------------------------------------------------------------


def test_layouts_match_gguf_and_a_wrong_one_is_caught() -> None:
    check_layouts()
    broken = kernel_source().replace("enum { QK = 256, TS = 144 }", "enum { QK = 256, TS = 146 }")
    with pytest.raises(AssertionError, match="BQ4_K"):
        check_layouts(broken)


def test_lookup_tables_come_from_gguf() -> None:
    kv = lookup_table(Q.IQ4_XS).view(np.int8)
    assert kv.tolist() == list(gq.IQ4_NL.kvalues)
    grid = lookup_table(Q.IQ3_XXS).view(np.uint8).reshape(256, 4)
    assert set(np.unique(grid).tolist()) <= set(gq.IQ3_XXS.grid_map)
    assert lookup_table(Q.Q4_K).size == 0


def test_engine_imports_without_cupy() -> None:
    code = (
        "import sys; import engine.kernels, engine.backend, engine.backend.telemetry; "
        "assert 'cupy' not in sys.modules, 'cupy imported at import time'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_dequantize_matches_gguf(cp, qtype: Q) -> None:
    from engine.kernels import dequantize

    rng = np.random.default_rng(int(qtype))
    shape = (48, 1024)
    raw = random_quant_bytes(rng, qtype, shape)
    ref = _ref(raw, qtype, shape)
    dev = cp.asarray(raw)
    out16 = dequantize(dev, qtype, shape).get().astype(np.float64)  # [48, 1024]
    out32 = dequantize(dev, qtype, shape, cp.float32).get().astype(np.float64)
    scale = np.abs(ref).max()
    # fp16: the reference rounded once (half an ulp, 2^-11 relative) plus fp32 FMA contraction
    assert np.all(np.abs(out16 - ref) <= np.abs(ref) * 2.0**-11 + 1e-6 * scale + 2.0**-24)
    assert np.all(np.abs(out32 - ref) <= 1e-6 * scale)
    assert np.isfinite(out16).all()


def _check_gemv(cp, qtype: Q, shape: tuple[int, int], n_batch: int, offset: int = 0) -> None:
    from engine.kernels import gemv

    rng = np.random.default_rng(1000 + int(qtype) + n_batch + offset)
    raw = random_quant_bytes(rng, qtype, shape)
    w = _ref(raw, qtype, shape)  # [n_out, n_in]
    buf = cp.zeros(raw.nbytes + 64, dtype=cp.uint8)
    buf[offset : offset + raw.nbytes] = cp.asarray(raw)
    x = rng.standard_normal((n_batch, shape[1])).astype(np.float32)  # [B, n_in]
    y = gemv(buf[offset : offset + raw.nbytes], qtype, shape, cp.asarray(x))  # [B, n_out]
    ref = x.astype(np.float64) @ w.T
    err = np.linalg.norm(y.get() - ref) / np.linalg.norm(ref)
    assert err < 2e-5, f"{qtype.name} {shape} B={n_batch} offset {offset}: rel err {err:.2e}"
    if n_batch == 1:
        y1 = gemv(buf[offset : offset + raw.nbytes], qtype, shape, cp.asarray(x[0])).get()
        assert y1.shape == (shape[0],)
        np.testing.assert_allclose(y1, y.get()[0], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_gemv_matches_numpy(cp, qtype: Q) -> None:
    _check_gemv(cp, qtype, (301, 2048), 1)  # rows not a multiple of a warp's rows
    _check_gemv(cp, qtype, (64, 2560), 3)  # a partial last chunk


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.IQ4_XS, Q.Q6_K], ids=lambda q: q.name)
def test_gemv_batches_rows_per_warp_and_alignment(cp, qtype: Q) -> None:
    _check_gemv(cp, qtype, (8200, 2048), 8)  # 4 rows per warp, 8 vectors
    _check_gemv(cp, qtype, (2050, 2048), 2)  # 2 rows per warp
    _check_gemv(cp, qtype, (40, 512), 1, offset=4)  # matrix start 4 bytes past a segment
    _check_gemv(cp, qtype, (40, 512), 1, offset=2)  # 2 bytes past (copied where 4 are needed)
    _check_gemv(cp, qtype, (2100, 768), 2)  # rows of Q6_K start at every even offset mod 16


def _moe_reference(h, ids, wts, host_blobs, layout) -> np.ndarray:
    out = np.zeros(h.shape, dtype=np.float64)
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            gate, up, down = (p.astype(np.float64) for p in layout.decode(host_blobs[ids[t, j]]))
            g, u = gate @ h[t], up @ h[t]  # [f]
            out[t] += wts[t, j] * (down @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "qtypes", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q5_0, Q.IQ4_XS), (Q.Q4_0, Q.Q4_0, Q.Q4_0)],
    ids=["q4k-q6k", "mixed", "q4_0"]  # one type: gate, up and down decode in one launch
)
def test_moe_prefill_matches_numpy(cp, qtypes) -> None:
    from engine.kernels import expert_fp16_bytes, moe_prefill

    rng = np.random.default_rng(7)
    n_tok, n_exp, k, d, f = 37, 8, 3, 256, 512
    layout = ExpertLayout(qtypes, ((f, d), (f, d), (d, f)))
    host_blobs = {}
    for e in range(n_exp):
        parts = [random_quant_bytes(rng, q, s) for q, s in zip(qtypes, layout.shapes)]
        host_blobs[e] = np.concatenate(parts)
    routable = [e for e in range(1, n_exp) if e != 5]  # expert 5 unused: only routed ones are read
    ids = np.stack([rng.choice(routable, k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[:, 1] = 0  # expert 0 takes every token: groups padded to unequal row counts
    wts = rng.random((n_tok, k)).astype(np.float32)
    h = rng.standard_normal((n_tok, d)).astype(np.float32)
    used = sorted(set(ids.reshape(-1).tolist()))
    dev_blobs = {e: cp.asarray(host_blobs[e]) for e in used}
    scratch = 2 * expert_fp16_bytes(layout)  # two experts per group: several groups
    counts = np.bincount(ids.reshape(-1), minlength=n_exp)  # rows per expert, read by the caller
    out = moe_prefill(cp.asarray(h), cp.asarray(ids), cp.asarray(wts), dev_blobs, layout,
                      counts=counts, scratch_bytes=scratch)  # fmt: skip
    assert out.shape == (n_tok, d) and out.dtype == cp.float32
    ref = _moe_reference(h.astype(np.float64), ids, wts, host_blobs, layout)
    err = np.linalg.norm(out.get() - ref) / np.linalg.norm(ref)
    assert err < 5e-3, f"moe rel err {err:.2e}"
    # the prompt path's call: host row counts given, blobs fetched and released per group
    fetched: list[list[int]] = []
    released: list[list[int]] = []
    again = moe_prefill(
        cp.asarray(h), cp.asarray(ids), cp.asarray(wts),
        lambda es: fetched.append(es) or [dev_blobs[e] for e in es], layout,
        scratch_bytes=scratch, counts=counts, release=released.append,
    )  # fmt: skip
    assert cp.array_equal(again, out)
    assert released == fetched and sorted(e for es in fetched for e in es) == used and fetched[0] == [0]
    # a ring of one slot where only even experts need one: groups hold one even expert each
    fetched.clear()
    ring1 = moe_prefill(
        cp.asarray(h), cp.asarray(ids), cp.asarray(wts),
        lambda es: fetched.append(es) or [dev_blobs[e] for e in es], layout,
        counts=counts, max_group=1, staged=lambda e: e % 2 == 0,
    )  # fmt: skip
    assert all(sum(e % 2 == 0 for e in es) <= 1 for es in fetched) and max(map(len, fetched)) > 1
    err = np.linalg.norm(ring1.get() - ref) / np.linalg.norm(ref)
    assert err < 5e-3, f"moe (ring of one slot) rel err {err:.2e}"

    from engine.kernels import moe_decode

    for n_dec in (1, 5):  # decode path: fused gemv on the quantized blobs
        got = moe_decode(cp.asarray(h[:n_dec]), ids[:n_dec], cp.asarray(wts[:n_dec]), dev_blobs,
                         layout).get()  # fmt: skip
        err = np.linalg.norm(got - ref[:n_dec]) / np.linalg.norm(ref[:n_dec])
        assert err < 2e-5, f"moe_decode B={n_dec} rel err {err:.2e}"


@pytest.mark.gpu
def test_gemv_many_runs_several_matrices_in_one_launch(cp) -> None:
    from engine.kernels import gemv_many

    rng = np.random.default_rng(11)
    shape, n_jobs = (96, 512), 5
    raws = [random_quant_bytes(rng, Q.Q4_K, shape) for _ in range(n_jobs)]
    slab = cp.asarray(np.concatenate(raws))  # matrices back to back, like cache slots
    ws = [slab[j * raws[0].nbytes : (j + 1) * raws[0].nbytes] for j in range(n_jobs)]
    x = rng.standard_normal((n_jobs, 2, shape[1])).astype(np.float32)  # [J, B, n_in]
    y = gemv_many(ws, Q.Q4_K, shape, cp.asarray(x)).get()  # [J, B, n_out]
    for j in range(n_jobs):
        ref = x[j].astype(np.float64) @ _ref(raws[j], Q.Q4_K, shape).T
        np.testing.assert_allclose(y[j], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    shared = cp.broadcast_to(cp.asarray(x[0, 0]), (n_jobs, shape[1]))  # one x for every job
    y1 = gemv_many(ws, Q.Q4_K, shape, shared).get()  # [J, n_out]
    for j in range(n_jobs):
        ref = _ref(raws[j], Q.Q4_K, shape) @ x[0, 0].astype(np.float64)
        np.testing.assert_allclose(y1[j], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_a_decoders_kernels_compile_together(cp) -> None:
    """Every batch size of a quant type's GEMV comes from one compile, made up front by
    `preload`: a decode step meeting a new batch (a verify window) never stalls on NVRTC."""
    from engine.kernels import dequant

    dequant.preload([Q.Q4_K, Q.Q6_K, Q.Q4_K])
    misses = dequant._module.cache_info().misses
    for qtype in (Q.Q4_K, Q.Q6_K):
        decoder = dequant.DECODERS[qtype]
        for part in dequant.PARTS:
            for name in dequant._names(decoder, part):
                assert dequant._function(decoder, part, name) is not None
    assert dequant._module.cache_info().misses == misses


WARM_UP_SCRIPT = """
import sys
from pathlib import Path
from gguf import GGMLQuantizationType as Q
from engine.kernels import dequant
from engine.kernels.warmup import compile_jobs, warm_up

cache = Path(sys.argv[1])
def files():
    return sum(1 for f in cache.rglob("*") if f.is_file())
qtypes = [Q.Q4_K, Q.Q6_K, Q.Q8_0]
dequant._module(dequant.DECODERS[Q.Q4_K], "gemv1")  # a RawModule made is not compiled
assert files() == 0, files()
seen = []
warm_up(qtypes, progress=lambda d, t: seen.append((d, t)), workers=4)
n = len(compile_jobs(qtypes))
assert seen == [(i, n) for i in range(n + 1)], seen
after = files()
assert after >= len(dequant.preload_jobs([*qtypes, Q.F16])), after
for q in [*qtypes, Q.F16]:  # F16: the GEMV of fp16 weights, always
    decoder = dequant.DECODERS[q]
    for part in dequant.PARTS:
        for name in dequant._names(decoder, part):
            dequant._function(decoder, part, name)
assert files() == after, (files(), after)  # every instantiation came from the warm-up
print("compiled", after)
"""


def test_the_warm_up_compiles_every_module_up_front_on_threads(cp, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`warm_up` compiles the modules of a model's quant types up front (a `RawModule`
    compiles at its first `get_function`, not when made) on a pool of threads, telling each
    one as it ends; afterwards no kernel of those types compiles. Run in a process of its own
    with an empty CuPy cache, whose files say what was compiled when."""
    import os

    cache = tmp_path / "cupy-cache"
    cache.mkdir()
    env = {**os.environ, "CUPY_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", WARM_UP_SCRIPT, str(cache)], check=False,
                          env=env, cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("compiled ")
