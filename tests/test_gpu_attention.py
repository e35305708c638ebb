"""Prompt-path causal attention on CUDA (`engine.kernels.attention`) against numpy `causal_gqa`.

GPU tests are marked `gpu` and skipped where CuPy is missing or finds no device; the import,
source and block-planning checks run everywhere.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from engine.backend.array_ops import causal_gqa
from engine.kernels import attention as attn

# -- everywhere -----------------------------------------------------------------------------------


def test_imports_without_cupy_and_finds_its_source() -> None:
    code = (
        "import sys; import engine.kernels.attention as a; "
        "assert 'cupy' not in sys.modules, 'cupy imported at import time'; "
        "assert 'causal_softmax_f16' in a.kernel_source()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    m = re.search(r"#define SOFTMAX_THREADS (\d+)", attn.kernel_source())
    assert m and int(m.group(1)) == attn._SOFTMAX_THREADS


@pytest.mark.parametrize(
    "t, pos0, n_head, budget",
    [
        (37, 0, 8, attn.DEFAULT_SCORE_BYTES),
        (1100, 0, 8, 1 << 20),
        (300, 517, 4, 200_000),
        (16384, 55616, 32, attn.DEFAULT_SCORE_BYTES),  # the largest prompt chunk of the plan
        (40, 1000, 32, 1),  # budget below 16 rows: 16-row blocks anyway
    ],
)
def test_blocks_cover_the_chunk_within_budget(t: int, pos0: int, n_head: int, budget: int) -> None:
    blocks = attn.plan_blocks(t, pos0, n_head, budget)
    assert blocks[0][0] == 0 and blocks[-1][1] == t
    for (a, b, ld), nxt in zip(blocks, blocks[1:] + [None]):
        n = b - a
        assert nxt is None or nxt[0] == b
        assert ld % attn.LD_ALIGN == 0 and pos0 + b <= ld < pos0 + b + attn.LD_ALIGN
        if nxt is not None:  # all but the last block: a multiple of 16 rows, >= 16
            assert n % attn.ROW_ALIGN == 0 and n >= attn.MIN_ROWS
        if n > attn.MIN_ROWS:  # past the minimum, the budget holds
            assert attn.block_score_bytes(n, pos0 + b, n_head) <= budget
    if budget == 1 << 20:
        assert len(blocks) > 3


def test_causal_flops_counts_visible_keys() -> None:
    t, pos0, h, d = 7, 5, 3, 4
    visible = sum(pos0 + i + 1 for i in range(t))
    assert attn.causal_flops(t, pos0, h, d) == 4 * h * d * visible


# -- on a GPU -------------------------------------------------------------------------------------

# Tolerance: q, k, v, the scores and the probabilities are rounded to fp16 (relative error
# 2^-11 ~ 4.9e-4 each), products are accumulated in fp32. A score s stored in fp16 is off by up
# to |s| * 2^-11 (|s| <= ~10 here, so <= 5e-3), which moves its probability by that fraction;
# the output is a convex combination of v rows, so its error is about (probability error + v
# rounding) times the typical |v|, scattered in sign: ~1e-3 of max |out| (a CPU emulation of the
# same rounding steps gave 0.6e-3 to 2e-3). 1e-2 of max |out| leaves a 5x margin while a wrong
# mask, row mapping or stride gives errors of order 1.
REL_TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n_head, n_kv, d", [(8, 2, 128), (4, 4, 64)], ids=["H8-Hkv2-D128", "H4-Hkv4-D64"]
)
@pytest.mark.parametrize(
    "t, pos0, score_bytes, kv_dtype",
    [
        (37, 0, attn.DEFAULT_SCORE_BYTES, np.float32),
        (300, 517, attn.DEFAULT_SCORE_BYTES, np.float32),
        (1100, 0, 1 << 20, np.float32),  # several query blocks
        (300, 517, 200_000, np.float16),  # several blocks after a cached prefix, fp16 K/V
    ],
    ids=["T37", "T300-pos517", "T1100-blocks", "T300-pos517-blocks-f16kv"],
)
def test_causal_attention_matches_numpy(
    cp, n_head: int, n_kv: int, d: int, t: int, pos0: int, score_bytes: int, kv_dtype: type
) -> None:
    from engine.kernels.attention import causal_attention

    rng = np.random.default_rng(t + pos0 + n_head)
    s = pos0 + t
    q = (rng.standard_normal((t, n_head, d)) * 2.0).astype(np.float32)  # scores of std ~2
    k = rng.standard_normal((s, n_kv, d)).astype(kv_dtype)
    v = rng.standard_normal((s, n_kv, d)).astype(kv_dtype)
    if score_bytes < attn.DEFAULT_SCORE_BYTES:
        assert len(attn.plan_blocks(t, pos0, n_head, score_bytes)) > 1
    got = causal_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0, score_bytes)
    assert got.dtype == cp.float32 and got.shape == (t, n_head, d)
    ref = causal_gqa(np, q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), pos0)
    err = float(np.abs(got.get() - ref).max() / np.abs(ref).max())
    assert err < REL_TOL, f"relative error {err:.2e}"


@pytest.mark.gpu
def test_first_query_sees_only_the_first_key(cp) -> None:
    """pos0 = 0: query 0 must return v[0] exactly up to fp16 rounding, whatever the scores."""
    from engine.kernels.attention import causal_attention

    rng = np.random.default_rng(5)
    t, h, hkv, d = 64, 8, 2, 128
    q = (rng.standard_normal((t, h, d)) * 8.0).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    got = causal_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), 0).get()
    want = np.repeat(v[0], h // hkv, axis=0)  # [H, D]: head j uses kv head j // G
    np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-3 * np.abs(v).max())
