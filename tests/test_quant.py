"""CPU dequantization: a tensor decoded in row chunks on the thread pool equals gguf-py's
decode of the whole tensor in one call, for every quant type the engine reads."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from engine.gguf import quant

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS", "BF16"]


@pytest.mark.parametrize("name", TYPES)
def test_chunked_decode_equals_one_call(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    qtype = GGMLQuantizationType[name]
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    n_rows, n_cols = 37, 512  # 37 rows: the last chunk is a short one
    rng = np.random.default_rng(1)
    # every byte & 0x3B: any two bytes read as an fp16 (or bf16) scale are finite
    raw = rng.integers(0, 256, (n_rows, n_cols // block * type_bytes), dtype=np.uint8) & 0x3B
    monkeypatch.setattr(quant, "CHUNK_BYTES", 5 * raw.shape[1])  # 5 rows per chunk: 8 chunks
    got = quant.dequantize_bytes(raw, qtype, (n_rows, n_cols))
    want = gq.dequantize(raw, qtype).astype(np.float32)
    assert got.shape == (n_rows, n_cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
