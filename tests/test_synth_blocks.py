"""Random quantized blocks of synthetic models: the requested spread, and `centered` blocks
symmetric around zero (the benchmark preset's balanced routing depends on it)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.synth.blocks import random_tensor
from engine.synth.model import PRESETS


def _decoded(qtype: Q, centered: bool) -> np.ndarray:
    raw = random_tensor(np.random.default_rng(0), qtype, (256, 2048), 0.02, centered=centered)
    return gq.dequantize(raw, qtype).reshape(256, 2048)  # [rows, cols]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K])
def test_centered_blocks_have_no_bias(qtype: Q) -> None:
    x = _decoded(qtype, centered=True)
    assert abs(x.std() / 0.02 - 1) < 0.05  # the spread asked for
    assert abs(x.mean()) < 0.01 * x.std()
    # row means at the level of independent noise (a biased row would sit far above it)
    assert x.mean(axis=1).std() * np.sqrt(x.shape[1]) / x.std() < 1.3


def test_uncentered_blocks_keep_the_known_biases() -> None:
    assert _decoded(Q.Q4_0, centered=False).mean() < -0.05 * 0.02  # d * (q - 8): mean -d/2
    k = _decoded(Q.Q4_K, centered=False)
    assert k.mean(axis=1).std() * np.sqrt(k.shape[1]) / k.std() > 2  # min != scale per sub-block


def test_the_benchmark_preset_is_centered_and_says_so_in_its_digest() -> None:
    spec = PRESETS["qwen3-30b-a3b"]
    assert spec.centered and not PRESETS["random-demo"].centered
    assert spec.digest() != replace(spec, centered=False).digest()


def test_tensors_made_ahead_on_threads_are_the_sequential_ones() -> None:
    from engine.synth.model import PRESETS, _made_in_order, make_tensor, synth_tensors

    spec = PRESETS["tiny"]
    tensors = synth_tensors(spec)
    want = [make_tensor(n, shape, q, spec) for n, (shape, q) in tensors.items()]
    for ahead in (1, 3):
        got = list(_made_in_order(tensors, spec, ahead=ahead))
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
