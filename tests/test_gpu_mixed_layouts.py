"""Files whose layers store their experts in different quant types (llama.cpp's mixes, as
`make-model --mix` writes them) on CUDA (gpu marker): the token graph with misses read over
the link, the grouped prefill through the staging ring, the cache's lend and refill, and the
loan, against the simulated device and against eager decoding."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import host, prefill_request

from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.synth.model import PRESETS, write_model

pytestmark = pytest.mark.gpu

LOAN = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                      retain_startup_chunk=True, repeat_loan=True, repeat_min_tokens=256)
TEXT = "the river runs through the old city "


@pytest.fixture(scope="module", params=["q4_k_m", "q2_k", "mxfp4_moe"])
def mixed_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               cp) -> Path:  # type: ignore[no-untyped-def]
    """Qwen3-30B-A3B shapes, 4 blocks + MTP, in a quantizer mix: Q4_K_M's ffn_down_exps are
    Q6_K on blocks 2 and 4 (the MTP block), Q4_K on the others."""
    spec = replace(PRESETS["qwen3-30b-a3b"], n_layer=4, n_ctx=8192, mix=request.param)
    path = write_model(tmp_path_factory.mktemp("mixed") / f"{request.param}.gguf", spec)
    if request.param == "q4_k_m":
        assert len(set(spec.layer_blob_bytes())) == 2
    return path


def _decode(loop: ServeLoop, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    rt = loop.rt
    logits, _ = prefill_request(rt, ids)
    rows, toks = [host(logits)[-1]], []
    for _ in range(n):
        toks.append(int(np.argmax(rows[-1])))
        rows.append(host(rt.session.forward([toks[-1]]).logits)[-1])
    return toks, np.stack(rows)


def test_graph_prefill_and_misses_match_the_simulated_device(mixed_path: Path) -> None:
    """A cache of 60 of the 512 experts: the prompt streams misses through the ring (grouped
    MoE), the graph reads missed experts in place over PCIe; against eager CUDA decoding and
    the simulated device (gguf's decoders)."""
    base = EngineOptions(model=str(mixed_path), device="cuda", ctx=4096, vram_limit="4GiB",
                         vram_segment_mib=64, expert_cache=60, kv="f16")
    graph = ServeLoop.create(base)
    eager = ServeLoop.create(replace(base, no_token_graph=True))
    sim = ServeLoop.create(EngineOptions(model=str(mixed_path), device="sim:8GiB", ctx=4096,
                                         expert_cache=60, kv="f16"))
    assert graph.rt.session.graph is not None
    ids = graph.rt.model.tokenizer.encode(TEXT * 30)
    ta, la = _decode(graph, ids, 8)
    tb, lb = _decode(eager, ids, 8)
    _, ls = _decode(sim, ids, 0)
    assert ta == tb
    assert float(np.abs(la - lb).max() / np.abs(lb).max()) < 1e-3
    assert float(np.abs(la[0] - ls[0]).max() / np.abs(ls[0]).max()) < 0.03
    c = graph.rt.experts.counters
    assert c.hits > 0 and c.streamed > 0
    for loop in (graph, eager):
        loop.rt.check_integrity()
        cache = loop.rt.cache
        for slot in range(cache.n_slots):  # each slot's front holds its expert's blob
            owner = cache.table.owner(slot)
            if owner is not None:
                blob = cache.host.blob(*owner)
                assert np.array_equal(host(cache.slot_view(slot))[: blob.nbytes], blob)


def test_loan_lend_and_refill_keep_the_tokens(mixed_path: Path) -> None:
    """Every loan sub-option, startup and repeat, with MTP drafts: the text of the loan-off
    engine; after each request nothing is lent and every refilled slot holds its expert."""
    base = EngineOptions(model=str(mixed_path), device="cuda", ctx=4096, serve=True,
                         vram_elastic=True, mtp=True, spec=2, vram_limit="4GiB",
                         vram_segment_mib=64, kv="q4_0", expert_cache=200)
    texts = []
    for flags in (LOAN, LoanFlags()):
        loop = ServeLoop.create(base, flags)
        conv = Conversation()
        out = [loop.chat(conv, t, max_new=12).text for t in ("hello", TEXT * 80, TEXT * 60)]
        texts.append(out)
        loop.rt.check_integrity()
        cache = loop.rt.cache
        assert cache.n_lent == 0 and loop.rt.resources.all_resident()
        for slot in range(cache.n_slots):
            owner = cache.table.owner(slot)
            if owner is not None:
                blob = cache.host.blob(*owner)
                assert np.array_equal(host(cache.slot_view(slot))[: blob.nbytes], blob)
        loop.close()
    assert texts[0] == texts[1]
