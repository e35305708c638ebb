"""The MTP (nextn) block, its releasable resources (experts, draft head, verifier), its KV kept
in step with the main session, and the least-squares fit that makes it predictive."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backend.array_ops import rms_norm
from engine.errors import FlagError, ModelError
from engine.experts.provider import DirectExperts
from engine.gguf import names
from engine.gguf.quant import dequantize
from engine.gguf.tokenizer import TokenType
from engine.model.loader import Model, load_model
from engine.model.moe import moe_block
from engine.model.mtp import MTPBlock, MTPExperts
from engine.request.record import generate
from engine.request.sampler import SamplingParams
from engine.request.session import Session
from engine.speculative.decoder import SpecDecoder
from engine.speculative.draft import MTPDraft
from engine.speculative.draft_head import DraftHead, select_draft_ids
from engine.speculative.verifier import Verifier
from engine.tools.fit_mtp import fit_mtp
from engine.trace.timing import Timing


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Model:
    return load_model(tiny_path)


def test_block_forward_matches_a_hand_computed_first_cell(model: Model) -> None:
    """At position 0 attention sees one key, so the block reduces to closed form; the
    projection input is [enorm(embedding), hnorm(hidden)] in that order."""
    hp = model.hp
    block = MTPBlock(model, DraftHead.from_model(model))
    rng = np.random.default_rng(0)
    h_prev = rng.standard_normal((1, hp.n_embd)).astype(np.float32) * 3
    tok = np.array([321])
    out = block.forward(h_prev, tok, 0, block.new_kv(8), logits="last")

    eps = hp.rms_eps
    w = {k: model.mf.tensor(names.nextn(k, hp.n_layer)) for k in ("eh_proj", "enorm", "hnorm")}
    eh, en, hn = (dequantize(w[k]) for k in ("eh_proj", "enorm", "hnorm"))
    e = model.transformer.embd.rows(tok)
    x = np.concatenate([rms_norm(np, e, en, eps), rms_norm(np, h_prev, hn, eps)], -1) @ eh.T
    a = block.block.attn
    wv, wo = (dequantize(model.mf.tensor(names.block(k, hp.n_layer))) for k in ("attn_v", "attn_output"))
    v = (rms_norm(np, x, a.norm, eps) @ wv.T).reshape(hp.n_head_kv, hp.head_dim)
    v = v.astype(np.float16).astype(np.float32)  # the KV cache stores f16
    heads = np.repeat(v, hp.n_head // hp.n_head_kv, axis=0)  # softmax over one key is 1
    x = x + heads.reshape(1, -1) @ wo.T
    be = model.transformer.backend
    ffn, _, _ = moe_block(be, hp, block.block, x, 0, DirectExperts(model.mtp_experts, be))
    x = x + ffn
    np.testing.assert_allclose(out.hidden, x, atol=1e-4, rtol=1e-4)
    want = rms_norm(np, x, block.shared_head_norm, eps) @ model.transformer.head.T
    np.testing.assert_allclose(out.logits, want, atol=1e-4, rtol=1e-4)
    # the other concat order gives a different block input: the check above pins the order
    swapped = np.concatenate([rms_norm(np, h_prev, hn, eps), rms_norm(np, e, en, eps)], -1) @ eh.T
    assert np.abs(swapped - x).max() > 0.1


def test_model_without_nextn_is_a_one_line_error(tiny_nomtp_path: Path) -> None:
    m = load_model(tiny_nomtp_path)
    for build in (lambda: MTPBlock(m, DraftHead.from_model(m)), lambda: SpecDecoder.with_mtp(m, 3)):
        with pytest.raises(ModelError, match=r"model has no MTP \(nextn\) layer; drop --mtp") as e:
            build()
        assert "\n" not in str(e.value) and tiny_nomtp_path.name in str(e.value)


def test_mtp_experts_release_restore_byte_identical(model: Model) -> None:
    be = model.transformer.backend
    ex = MTPExperts(model.mtp_experts, be)
    host = model.mtp_experts
    assert ex.nbytes == host.n_expert * host.blob_bytes == ex.data.nbytes
    before = ex.data.copy()
    ref = DirectExperts(host, be)
    ex.prepare(0, [3]), ref.prepare(0, [3])
    for a, b in zip(ex.weights(0, 3), ref.weights(0, 3)):
        np.testing.assert_array_equal(a, b)
    assert ex.release() == ex.nbytes and not ex.resident and ex.release() == 0
    with pytest.raises(AssertionError, match="released"):
        ex.weights(0, 3)
    assert ex.restore() == ex.nbytes and ex.resident
    np.testing.assert_array_equal(ex.data, before)
    ex.check_integrity(deep=True)
    ex.data[2, 5] ^= 0xFF  # corruption is caught
    with pytest.raises(AssertionError, match="checksum"):
        ex.check_integrity(deep=True)


def test_a_partial_mtp_expert_region_uploads_misses_into_lru_slots(model: Model) -> None:
    """Three slots for the nextn block's experts: a miss is uploaded into the least recently
    used slot the call does not read, a call reading more experts than slots gets the rest
    as transient copies, the bytes are always the file's, and a restore after a loan brings
    back the experts the slots held."""
    be, host = model.transformer.backend, model.mtp_experts
    ex = MTPExperts(host, be, n_slots=3)
    assert ex.partial and ex.data.shape == (3, host.blob_bytes) and ex.nbytes == 3 * host.blob_bytes
    file = lambda e: host.blob(0, e)  # noqa: E731
    for e, blob in zip([0, 1, 2], ex.blobs(0, [0, 1, 2])):
        np.testing.assert_array_equal(blob, file(e))
    assert (ex.n_uploads, ex.n_hits) == (3, 0)
    ex.blobs(0, [0])  # 0 is now the most lately used; 1 the least
    np.testing.assert_array_equal(ex.blobs(0, [3])[0], file(3))
    assert sorted(ex._owner.tolist()) == [0, 2, 3] and (ex.n_uploads, ex.n_hits) == (4, 1)
    four = ex.blobs(0, [4, 5, 6, 7])  # more than the slots: the fourth is a transient copy
    for e, blob in zip([4, 5, 6, 7], four[:3]):
        np.testing.assert_array_equal(blob, file(e))
    np.testing.assert_array_equal(four[3], file(7))
    assert sorted(ex._owner.tolist()) == [4, 5, 6]
    ref = DirectExperts(host, be)
    for a, b in zip(ex.weights(0, 1), ref.weights(0, 1)):
        np.testing.assert_array_equal(a, b)
    ex.check_integrity(deep=True)
    held = sorted(ex._owner.tolist())
    assert ex.release() == ex.nbytes and ex.restore() == ex.nbytes
    assert sorted(ex._owner.tolist()) == held
    ex.check_integrity(deep=True)
    ex.data[0, 5] ^= 0xFF
    with pytest.raises(AssertionError, match="checksum"):
        ex.check_integrity(deep=True)


def test_draft_vocab_selection(model: Model) -> None:
    tok = model.tokenizer
    v = tok.n_vocab
    assert np.array_equal(select_draft_ids(tok, 0), np.arange(v))
    assert np.array_equal(select_draft_ids(tok, v + 5), np.arange(v))
    ids = select_draft_ids(tok, 100)
    assert ids.size == 100 and set(tok.eog_ids) <= set(ids.tolist())
    types = np.asarray(tok.token_types)
    others = [i for i in ids.tolist() if i not in tok.eog_ids]
    assert others == list(range(len(others)))  # the first regular ids, in BPE merge order
    assert all(types[i] != TokenType.CONTROL for i in others)
    counts = np.zeros(v)
    counts[[900, 5, 700]] = [30, 20, 10]
    ids = select_draft_ids(tok, len(tok.eog_ids) + 3, counts)
    assert set(ids.tolist()) == {900, 5, 700, *tok.eog_ids}
    for bad in (-1, len(tok.eog_ids)):
        with pytest.raises(FlagError, match="--draft-vocab"):
            select_draft_ids(tok, bad)


@pytest.mark.parametrize("draft_vocab", [0, 257])
def test_draft_head_rows_release_restore(model: Model, draft_vocab: int) -> None:
    head = DraftHead.from_model(model, draft_vocab)
    n = draft_vocab or model.hp.n_vocab
    assert head.n_rows == n and head.nbytes == n * model.hp.n_embd * 4 == head.rows.nbytes
    np.testing.assert_array_equal(head.rows, model.transformer.head[head.ids])
    before = head.rows.copy()
    assert head.release() == head.nbytes and not head.resident
    with pytest.raises(AssertionError, match="released"):
        head.logits(np.zeros((1, model.hp.n_embd), np.float32))
    assert head.restore() == head.nbytes
    np.testing.assert_array_equal(head.rows, before)
    head.check_integrity(deep=True)
    full = head.full_logits(np.arange(n, dtype=np.float32))
    assert full.shape == (model.hp.n_vocab,) and np.array_equal(full[head.ids], np.arange(n))
    assert draft_vocab == 0 or np.isneginf(np.delete(full, head.ids)).all()
    # the rows came from the native head's host copy; decoding the file gives the same rows
    from_file = DraftHead(head.source, head.ids, head.backend)
    np.testing.assert_array_equal(from_file.rows, before)


def test_verifier_buffers_release_restore(model: Model) -> None:
    hp = model.hp
    ver = Verifier.for_model(model, 6)
    assert ver.nbytes == 6 * (hp.n_vocab + hp.n_embd) * 4
    assert ver.nbytes == ver.logits.nbytes + ver.hidden.nbytes
    ids = [5, 77, 300, 2, 9]
    s = Session(model, 64)
    s.prefill([1, 2, 3], 512)
    got = ver.verify(s, ids).copy()
    ref = Session(model, 64)
    ref.prefill([1, 2, 3], 512)
    want = np.asarray(ref.forward(ids, logits="all").logits)
    np.testing.assert_array_equal(got, want)
    zero = np.zeros_like(ver.logits)
    assert ver.release() == ver.nbytes and not ver.resident and ver.release() == 0
    assert ver.restore() == ver.nbytes
    np.testing.assert_array_equal(ver.logits, zero)  # scratch comes back zeroed
    ver.check_integrity()
    s.truncate(3)
    np.testing.assert_array_equal(ver.verify(s, ids), got)


def test_mtp_kv_matches_a_clean_catch_up(model: Model) -> None:
    """After speculative decoding with rejections, the MTP cells equal those of a fresh MTP
    block run once over the main model's hidden states of the final token sequence."""
    dec = SpecDecoder.with_mtp(model, 4)
    draft = dec.draft
    assert isinstance(draft, MTPDraft)
    ids = np.random.default_rng(3).integers(0, 1000, 21).tolist()
    s = Session(model, 256)
    out = list(generate(s, ids, 30, SamplingParams(), 5, spec=dec))
    assert draft.kv is not None and draft.n_cells == len(s.tokens) == draft.kv.n_tokens
    assert draft.seq == [*s.tokens, out[-1]]

    clean = Session(model, 256)
    hidden = np.asarray(clean.forward(s.tokens, logits="none").hidden)  # [n, d]
    fresh = MTPDraft(dec.draft.block)
    fresh.bind(clean)
    fresh.observe(clean, 0, hidden, [*s.tokens[1:], out[-1]])
    n = draft.n_cells
    kv_a, kv_b = draft.kv.read(0, n), fresh.kv.read(0, n)
    for a, b in zip(kv_a, kv_b):
        np.testing.assert_allclose(a, b, atol=4e-3, rtol=2e-3)  # f16 cells, one ulp apart at most
    np.testing.assert_allclose(draft._logits, fresh._logits, atol=1e-3)


@pytest.mark.slow
def test_fit_makes_the_mtp_block_predictive(tiny_path: Path, tmp_path: Path) -> None:
    dst = tmp_path / "tiny-fit.gguf"
    report = fit_mtp(tiny_path, dst, n_seq=48, n_prompt=12, n_gen=64)
    assert report.accuracy_before < 0.05
    assert report.accuracy_after > 0.2 and report.accuracy_after > report.accuracy_linear
    src, fitted = load_model(tiny_path), load_model(dst)
    i = src.hp.n_layer
    changed = {
        names.nextn("eh_proj", i),
        names.nextn("shared_head_norm", i),
        names.block("ffn_down_exps", i),
    }
    for name, t in src.mf.tensors.items():
        same = np.array_equal(t.raw, fitted.mf.tensors[name].raw)
        assert same != (name in changed), name
    # the verifier accepts the fitted drafts; greedy output is unchanged
    rates = {}
    for label, m in (("random", src), ("fitted", fitted)):
        timing = Timing()
        dec = SpecDecoder.with_mtp(m, 2)
        for seed in range(3):
            ids = np.random.default_rng(seed).integers(0, 1000, 16).tolist()
            want = list(generate(Session(src, 256), ids, 40, SamplingParams()))
            assert (
                list(generate(Session(m, 256), ids, 40, SamplingParams(), timing=timing, spec=dec))
                == want
            )
        rates[label] = timing.drafts_accepted / timing.drafts_offered
    assert rates["random"] < 0.05 and rates["fitted"] > 0.15, rates
