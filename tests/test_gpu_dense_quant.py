"""Dense linear weights in their quantized blocks on CUDA (`--dense quant`, gpu marker): the
backend's `linear` against a float64 reference, and the engine against decoded weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import host, prefill_request
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.config import EngineOptions
from engine.gguf.quant import QuantMatrix, dequantize_bytes
from engine.runtime.serve import ServeLoop

pytestmark = pytest.mark.gpu
RNG = np.random.default_rng(5)


@pytest.fixture(scope="module")
def cuda(cp):  # type: ignore[no-untyped-def]
    from engine.backend.cuda import CudaBackend

    return CudaBackend(0)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_1])
@pytest.mark.parametrize(("rows", "tol"), [
    (1, 1e-5), (3, 1e-5), (8, 1e-5),  # the fused dequantize-GEMV: float32 products
    (9, 2e-3), (300, 2e-3),  # decoded to fp16 in row slices, cuBLAS on x rounded to fp16
])  # fmt: skip
def test_linear_reads_blocks(cp, cuda, monkeypatch, qtype: Q, rows: int, tol: float) -> None:  # type: ignore[no-untyped-def]
    from engine.backend import cuda_ops

    monkeypatch.setattr(cuda_ops, "DECODE_SLICE_BYTES", 2 * 512 * 96)  # 96-row slices of 650
    w = (RNG.standard_normal((650, 512)) * 0.05).astype(np.float32)
    raw = gq.quantize(w, qtype)  # uint8 [650, row_bytes]
    x = RNG.standard_normal((rows, 512)).astype(np.float32)
    m = QuantMatrix(cuda.to_device(raw.reshape(-1)), qtype, (650, 512))
    got = cuda.download(cuda.linear(cp.asarray(x), m))
    want = x.astype(np.float64) @ dequantize_bytes(raw, qtype, (650, 512)).astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (rows, 650)
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= tol


def test_engine_on_blocks_matches_decoded_weights(cp, demo_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The demo on CUDA (token graph on): quantized and decoded dense weights give first-token
    logits within fp16 rounding and the same greedy reply with MTP drafting, up to a token where
    the decoded weights' two candidates are a near-tie (within that rounding), which may flip."""
    loops, out = {}, {}
    try:
        for dense in ("quant", "float"):
            loop = loops[dense] = ServeLoop.create(EngineOptions(
                model=str(demo_path), device="cuda", ctx=2048, vram_limit="2GiB",
                vram_segment_mib=2, dense=dense, mtp=True, spec=2, spec_always=True))
            assert isinstance(loop.rt.model.transformer.head, QuantMatrix) == (dense == "quant")
            ids = loop.rt.model.tokenizer.encode("the river runs through the old city " * 40)
            logits, _ = prefill_request(loop.rt, ids)
            loop.rt.session.truncate(0)
            reply = loop.complete(list(ids), max_new=32)
            out[dense] = (host(logits)[-1], reply.text, loop.rt.session.tokens[len(ids):])
            loop.rt.check_integrity()
            assert loop.rt.session.graph is not None and loop.rt.session.graph.n_captures > 0
        (lq, tq, gq), (lf, tf, gf) = out["quant"], out["float"]
        assert float(np.abs(lq - lf).max() / np.abs(lf).max()) < 2e-3
        k = next((i for i, (a, b) in enumerate(zip(gq, gf, strict=False)) if a != b), None)
        if k is None:
            assert tq == tf
            return
        at = {}  # logits [vocab] of both after the common prefix, at the first differing token
        for dense, loop in loops.items():
            loop.rt.session.truncate(0)
            logits, _ = prefill_request(loop.rt, ids + gf[:k])
            at[dense] = host(logits)[-1]
        scale = float(np.abs(at["float"]).max())
        assert float(np.abs(at["quant"] - at["float"]).max()) < 2e-3 * scale
        gap = abs(float(at["float"][gf[k]] - at["float"][gq[k]]))
        assert gap < 2e-3 * scale, (k, gap / scale, tq, tf)
    finally:
        for loop in loops.values():
            loop.close()
