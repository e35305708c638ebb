"""Dense linear weights kept in their quantized blocks (`--dense quant`): the same model as
decoded weights, sized exactly as the planner counts them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import host, prefill_request

from engine.config import EngineOptions
from engine.errors import FlagError
from engine.gguf import names
from engine.gguf.quant import QuantMatrix, keeps_quantized, row_bytes
from engine.memory.arena import padded
from engine.memory.costs import Shapes, dense_bytes, head_bytes
from engine.model.loader import load_model
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from engine.speculative.draft_head import NativeDraftHead


def loop_for(path: Path, dense: str, draft_vocab: int = 0) -> ServeLoop:
    return ServeLoop.create(EngineOptions(model=str(path), ctx=1024, dense=dense, mtp=True, spec=2,
                                          spec_always=True, draft_vocab=draft_vocab))


@pytest.mark.parametrize("draft_vocab", [0, 3000])
def test_quantized_weights_compute_what_decoded_weights_do(demo_path: Path, draft_vocab: int) -> None:
    """The trained demo (Q8_0 attention, head and eh_proj) on the simulated device: the same
    first-token logits (float32 sums in another order) and the same greedy reply, drafts
    included, with the weights in their blocks and decoded; the draft head is the native head
    itself, or (a draft vocabulary) its own rows, quantized like the head."""
    out = {}
    for dense in ("quant", "float"):
        loop = loop_for(demo_path, dense, draft_vocab)
        tr = loop.rt.model.transformer
        kept = isinstance(tr.blocks[0].attn.wqkv, QuantMatrix)
        assert kept == (dense == "quant") and isinstance(tr.head, QuantMatrix) == kept
        block = loop.rt.spec.draft.block
        assert isinstance(block.eh_proj, QuantMatrix) == kept
        if draft_vocab:
            assert isinstance(block.head.rows, QuantMatrix) == kept
        else:
            assert isinstance(block.head, NativeDraftHead)
            assert "mtp.draft_head" not in {r.name for r in loop.rt.ledger.snapshot().regions}
        ids = loop.rt.model.tokenizer.encode("what is the meaning of the word harbor?")
        logits, _ = prefill_request(loop.rt, ids)
        loop.rt.session.truncate(0)
        reply = loop.chat(Conversation(), "What does harbor mean?", SamplingParams(), 24)
        out[dense] = (host(logits), reply.text)
        loop.rt.check_integrity()
    (lq, tq), (lf, tf) = out["quant"], out["float"]
    assert np.abs(lq - lf).max() <= 1e-5 * np.abs(lf).max()
    assert tq == tf and tq


@pytest.mark.parametrize("dense", ["quant", "float"])
def test_dense_and_head_regions_hold_what_the_costs_say(demo_path: Path, dense: str) -> None:
    """The planner's dense and head bytes are exactly what loading carves from the regions."""
    loop = loop_for(demo_path, dense, draft_vocab=3000)
    ledger = loop.rt.ledger
    costs = loop.rt.costs
    for region, want in (("weights.dense", costs.dense_bytes), ("head.native", costs.head_bytes),
                         ("mtp.draft_head", costs.draft_head_bytes)):
        assert padded(ledger.region(region).carved_bytes) == want, region
    loop.rt.check_integrity()


def test_quantized_sizes_are_the_files_blocks(demo_path: Path) -> None:
    """Kept quantized, the attention matrices and the head cost their bytes in the file; the
    rest (norms, router) stays float32 on the simulated device."""
    model = load_model(demo_path, build=False)
    shapes, hp = Shapes.of(model), model.hp
    mf = model.mf
    matrices = [names.block(k, i) for i in range(hp.n_layer)
                for k in ("attn_q", "attn_k", "attn_v", "attn_output")]
    assert all(keeps_quantized(mf.tensor(n).qtype) for n in matrices)
    in_file = sum(mf.tensor(n).n_bytes for n in matrices)
    as_floats = sum(4 * mf.tensor(n).shape[0] * mf.tensor(n).shape[1] for n in matrices)
    saved = dense_bytes(shapes, False, 4) - dense_bytes(shapes, False, 4, quant=True)
    assert abs(saved - (as_floats - in_file)) <= 512 * hp.n_layer  # alignment padding only
    head = mf.tensor(names.OUTPUT)
    assert head_bytes(shapes, 4, quant=True) >= head.shape[0] * row_bytes(head.qtype, head.shape[1])
    assert head_bytes(shapes, 4, quant=True) < head_bytes(shapes, 4) // 3


def test_bad_dense_option_is_one_line() -> None:
    with pytest.raises(FlagError, match="--dense fp8 must be one of auto, quant, float"):
        EngineOptions(dense="fp8")
