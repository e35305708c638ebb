"""Quant mixes without the oracle: the quantizer's layer rule, `make-model --mix`, what `info`
and `plan` print of a mixed file, and the cache, ring and prefill over layers whose blobs
differ in size (tests/test_quant_corpus.py holds the mixes against llama.cpp's own files)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import prefill_request
from gguf import GGMLQuantizationType as Q

from engine.backend import SimBackend
from engine.cli import main
from engine.config import EngineOptions
from engine.experts.cache import ExpertCache
from engine.experts.host import ArrayHostExperts
from engine.experts.residency import residency_readers
from engine.gguf.reader import open_gguf
from engine.gguf.type_mix import layer_ranges, type_mix
from engine.memory.ledger import Ledger
from engine.memory.ring import StagingRing
from engine.memory.sizes import KiB, MiB
from engine.runtime.serve import ServeLoop
from engine.synth.mixes import use_more_bits
from engine.synth.model import PRESETS, write_model

WIDE = replace(PRESETS["tiny"], n_embd=256, n_ff_exp=256, head_dim=64, n_layer=8, n_expert=16,
               seed=3)


def test_use_more_bits_is_the_quantizers_layer_rule() -> None:
    """48 layers (Qwen3-30B-A3B + MTP = 49 blocks): the first and last eighth, every third
    between."""
    more = [i for i in range(49) if use_more_bits(i, 49)]
    assert layer_ranges(more) == "0-5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41-48"


def test_layer_ranges() -> None:
    assert layer_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert layer_ranges([]) == ""


def test_make_model_mix_info_and_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    assert main(["make-model", str(out), "--preset", "tiny", "--hidden", "256", "--ff", "256",
                 "--head-dim", "64", "--layers", "8", "--mix", "Q4_K_M"]) == 0
    mix = type_mix(open_gguf(out))
    assert mix["ffn_down_exps"] == {"Q6_K": [0, 3, 6, 7, 8], "Q4_K": [1, 2, 4, 5]}
    assert mix["ffn_gate_exps"] == {"Q4_K": list(range(9))} and mix["output"] == {"Q6_K": []}
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "file type     Q4_K_M" in info
    assert "ffn_down_exps         Q6_K in 0, 3, 6-8; Q4_K in 1-2, 4-5" in info
    assert main(["plan", "--model", str(out), "--device", "sim:64MiB", "--ctx", "2048"]) == 0
    plan = capsys.readouterr().out
    assert "blobs   110,592 B in layers 1-2, 4-5; 127,488 B in layers 0, 3, 6-7" in plan
    assert "every slot holds the largest (6.6% of a full cache unused)" in plan


def test_make_model_refuses_an_unknown_mix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["make-model", str(tmp_path / "m.gguf"), "--preset", "tiny", "--mix", "q4_k_x"])
    assert e.value.code == 2 and "invalid choice: 'q4_k_x'" in capsys.readouterr().err


def _mixed_host() -> ArrayHostExperts:
    rng = np.random.default_rng(4)
    blobs = rng.integers(0, 256, (3, 8, 3000), dtype=np.uint8)
    return ArrayHostExperts(blobs, layer_bytes=(3000, 2200, 2600))


def test_cache_slots_take_each_layers_blob_at_the_front() -> None:
    host = _mixed_host()
    ledger = Ledger(SimBackend(4 * MiB), segment_bytes=64 * KiB)
    cache = ExpertCache(ledger, host, 12)
    assert cache.blob_bytes == 3000
    order = [(layer, e) for e in range(8) for layer in range(3)]
    cache.fill(order)
    stats = cache.backend.stats.snapshot()
    assert stats.h2d_bytes == 4 * (3000 + 2200 + 2600)  # each blob's own bytes, not the slot's
    assert cache.slack_bytes() == 4 * (800 + 400)
    cache.stage_residency(residency_readers(profile_present=True, borrow=True,
                                            chunk_tokens=512, token_graph=False))
    lent = cache.lend_tail(5)
    lent.view[:] = 0xAB  # the prompt path scribbles over the whole slots
    cache.refill(lent)
    for slot in range(12):
        layer, e = cache.table.owner(slot)
        n = host.layer_blob_bytes[layer]
        assert np.array_equal(np.asarray(cache.slot_view(slot))[:n], host.blob(layer, e))
    cache.check_integrity()


def test_ring_stages_smaller_blobs_at_the_front() -> None:
    host = _mixed_host()
    be = SimBackend(MiB)
    ring = StagingRing(be, np.zeros((3, 3000), dtype=np.uint8))
    views = ring.stage_group(1, [0, 5], host.pieces)
    for view, e in zip(views, (0, 5)):
        assert np.array_equal(view[:2200], host.blob(1, e))
    assert ring.bytes_uploaded == 2 * 2200


def test_a_mixed_file_prefills_and_decodes_with_misses(tmp_path: Path) -> None:
    """Q4_K_M on a cache that holds 20 of 128 experts: prompt chunks stream misses through the
    ring; the tokens and logits are those of a device that caches every expert."""
    path = write_model(tmp_path / "mixed.gguf", replace(WIDE, mix="q4_k_m"))
    small = ServeLoop.create(EngineOptions(model=str(path), device="sim:64MiB", ctx=1024,
                                           expert_cache=20, prefill=256))
    big = ServeLoop.create(EngineOptions(model=str(path), device="sim:64MiB", ctx=1024,
                                         prefill=256))
    assert small.rt.cache.n_slots == 20 and big.rt.cache.n_slots == 128
    ids = small.rt.model.tokenizer.encode("the river runs through the old city " * 40)
    a, _ = prefill_request(small.rt, ids)
    b, _ = prefill_request(big.rt, ids)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert small.rt.experts.counters.streamed > 0
    small.rt.check_integrity()
    assert {q for lay in small.rt.model.experts.layouts for q in lay.qtypes} == {Q.Q4_K, Q.Q6_K}


def test_every_type_the_engine_reads_has_a_cuda_decoder_and_stays_in_its_blocks() -> None:
    """The three lists agree: what the loader accepts, what the kernels decode, what a dense
    weight is kept in on a device that computes from quantized bytes."""
    from engine.gguf.quant import KEPT_QUANTIZED
    from engine.gguf.reader import SUPPORTED_QTYPES
    from engine.kernels.dequant import DECODERS

    assert set(DECODERS) == SUPPORTED_QTYPES
    assert KEPT_QUANTIZED == SUPPORTED_QTYPES - {Q.F32, Q.F16, Q.BF16}


def test_mixed_attention_types_stay_in_their_blocks(tmp_path: Path) -> None:
    """Q4_K_M gives attn_v Q6_K and q/k Q4_K on some layers: `--dense quant` keeps each in its
    blocks (a `QuantStack`), computes what decoded weights do, and the weights region holds
    exactly what the planner counts."""
    from engine.gguf.quant import QuantMatrix, QuantStack
    from engine.memory.arena import padded

    path = write_model(tmp_path / "mixed.gguf", replace(WIDE, mix="q4_k_m"))
    out = {}
    for dense in ("quant", "float"):
        loop = ServeLoop.create(EngineOptions(model=str(path), device="sim:64MiB", ctx=1024,
                                              dense=dense, mtp=True, spec=2))
        blocks = loop.rt.model.transformer.blocks
        if dense == "quant":
            assert isinstance(blocks[0].attn.wqkv, QuantStack)  # block 0: attn_v Q6_K
            assert isinstance(blocks[1].attn.wqkv, QuantMatrix)  # block 1: all Q4_K
        ledger, costs = loop.rt.ledger, loop.rt.costs
        assert padded(ledger.region("weights.dense").carved_bytes) == costs.dense_bytes
        ids = loop.rt.model.tokenizer.encode("the river runs through the old city " * 10)
        logits, _ = prefill_request(loop.rt, ids)
        step = loop.rt.session.forward([5]).logits  # a decode step: a few rows, one per part
        out[dense] = (np.asarray(logits), np.asarray(step))
        loop.rt.check_integrity()
    for q, f in zip(out["quant"], out["float"]):
        assert np.abs(q - f).max() <= 1e-5 * np.abs(f).max()
