"""Speculative decoding: greedy identity with plain decoding, accept-all / accept-none draft
sources, KV state after rejections, the rejection-sampling rule, and the benchmark command."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from drafts import AdversarialDraft, TargetDraft

from engine.cli.bench_spec import bench, format_table, parse_specs
from engine.errors import FlagError
from engine.model.loader import Model, load_model
from engine.request.record import generate
from engine.request.sampler import Sampler, SamplingParams
from engine.request.session import Session
from engine.speculative.decoder import SpecDecoder
from engine.speculative.verifier import Verifier
from engine.trace.timing import Timing

GREEDY = SamplingParams()
# prompt lengths: a single token, shorter than a chunk, several chunks, and a longer one
PROMPT_LENGTHS = (1, 5, 23, 70)
# chi-square 0.999 quantile for 5 degrees of freedom (6 outcomes)
CHI2_5DOF_P999 = 20.515


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Model:
    return load_model(tiny_path)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def plain(
    model: Model, ids: list[int], max_new: int, chunk: int, **kw
) -> tuple[list[int], Session]:  # type: ignore[no-untyped-def]
    s = Session(model, n_ctx=kw.pop("n_ctx", 512))
    return list(generate(s, ids, max_new, kw.pop("params", GREEDY), chunk, **kw)), s


def spec_run(dec: SpecDecoder, model: Model, ids: list[int], max_new: int, chunk: int, **kw):  # type: ignore[no-untyped-def]
    s = Session(model, n_ctx=kw.pop("n_ctx", 512))
    timing = Timing()
    out = list(generate(s, ids, max_new, kw.pop("params", GREEDY), chunk, timing=timing, **kw, spec=dec))
    return out, s, timing


@pytest.mark.parametrize("n_window", range(2, 9))
def test_greedy_mtp_spec_equals_plain_decoding(model: Model, n_window: int) -> None:
    dec = SpecDecoder.with_mtp(model, n_window)
    dec.always = True  # every step drafts (the policy would stop where drafts do not pay)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids = prompt(n, seed=n_window * 10 + i)
        chunk = 7 if i % 2 else 512  # chunked prefill on every other prompt
        want, ref = plain(model, ids, 40, chunk)
        got, s, timing = spec_run(dec, model, ids, 40, chunk)
        assert got == want, (n_window, n)
        assert s.tokens == ref.tokens and s.kv.n_tokens == len(ids) + len(got) - 1
        assert timing.generated == len(got) and timing.drafts_offered > 0
        assert sum(timing.accepted_hist.values()) > 0
        dec.check_integrity()


@pytest.mark.parametrize("source", [TargetDraft, AdversarialDraft])
def test_greedy_test_sources_equal_plain_decoding(model: Model, source: type) -> None:
    for n_window in (2, 5, 8):
        dec = SpecDecoder(n_window, source(), Verifier.for_model(model, n_window))
        ids = prompt(17, seed=n_window)
        want, _ = plain(model, ids, 30, 6)
        got, _, timing = spec_run(dec, model, ids, 30, 6)
        assert got == want
        assert timing.drafts_offered > 0
        if source is TargetDraft:
            assert timing.drafts_accepted == timing.drafts_offered
            assert set(timing.accepted_hist) <= {n_window - 1, *range(n_window - 1)}
            assert timing.accepted_hist.get(n_window - 1, 0) >= 1
        else:
            assert timing.drafts_accepted == 0 and set(timing.accepted_hist) == {0}


def test_stops_match_plain_decoding(model: Model) -> None:
    """Stop tokens, max_new and a full context end generation where plain decoding does."""
    dec = SpecDecoder(6, TargetDraft(), Verifier.for_model(model, 6))
    ids = prompt(12, seed=3)
    free, _ = plain(model, ids, 40, 512)
    stop = frozenset({free[9]})  # a token drafts will accept in the middle of a window
    cases = [{"stop_ids": stop}, {"n_ctx": len(ids) + 13}, {"n_ctx": len(ids) + 1}]
    for max_new in (1, 2, 3, 40):
        for kw in cases:
            want, ref = plain(model, ids, max_new, 512, **dict(kw))
            got, s, _ = spec_run(dec, model, ids, max_new, 512, **dict(kw))
            assert got == want, (max_new, kw)
            assert s.tokens == ref.tokens, (max_new, kw)


def test_after_rejections_kv_matches_a_clean_run(model: Model) -> None:
    """After drafts are rejected, the main KV holds exactly the accepted tokens: the logits of
    the next token equal those of a session that never speculated."""
    ids = prompt(29, seed=4)
    for source in (AdversarialDraft(), None):
        dec = (
            SpecDecoder(5, source, Verifier.for_model(model, 5))
            if source
            else SpecDecoder.with_mtp(model, 5)
        )
        got, s, timing = spec_run(dec, model, ids, 25, 8)
        assert timing.drafts_offered > timing.drafts_accepted  # there were rejections
        want, ref = plain(model, ids, 25, 8)
        assert got == want
        assert s.kv.n_tokens == len(s.tokens) == len(ids) + len(got) - 1
        a = np.asarray(s.forward([got[-1]]).logits)
        b = np.asarray(ref.forward([got[-1]]).logits)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_multi_turn_reuses_the_prefix_like_plain_decoding(model: Model) -> None:
    dec = SpecDecoder.with_mtp(model, 4)
    s_spec, s_plain = Session(model, 512), Session(model, 512)
    ids = prompt(20, seed=5)
    for turn in range(3):
        t_spec, t_plain = Timing(), Timing()
        a = list(generate(s_spec, ids, 15, GREEDY, 8, timing=t_spec, spec=dec))
        b = list(generate(s_plain, ids, 15, GREEDY, 8, timing=t_plain))
        assert a == b and s_spec.tokens == s_plain.tokens
        if turn:  # at most one token less reused: the MTP cell of the last KV token
            assert t_plain.reused_tokens - 1 <= t_spec.reused_tokens <= t_plain.reused_tokens
            assert t_spec.reused_tokens > len(ids) // 2
        dec.check_integrity()
        ids = ids + a + prompt(6, seed=50 + turn)


@pytest.mark.parametrize("end", ["max_new", "stop"])
def test_a_one_token_turn_keeps_the_prefix_for_the_next(model: Model, end: str) -> None:
    """A turn that ends at its first token (max_new 1, or a stop id) still lets the draft
    read the prompt: the next turn reuses what plain decoding reuses, not 0 tokens."""
    dec = SpecDecoder.with_mtp(model, 4)
    s_spec, s_plain = Session(model, 512), Session(model, 512)
    ids = prompt(40, seed=7)
    for turn in range(3):
        first = plain(model, ids, 1, 8)[0]
        max_new, stops = (1, frozenset()) if end == "max_new" else (5, frozenset(first))
        t_spec, t_plain = Timing(), Timing()
        a = list(generate(s_spec, ids, max_new, GREEDY, 8, stop_ids=stops, timing=t_spec, spec=dec))
        b = list(generate(s_plain, ids, max_new, GREEDY, 8, stop_ids=stops, timing=t_plain))
        assert a == b == first and s_spec.tokens == s_plain.tokens == ids
        if turn:  # a chat's next prompt holds the answer: nothing more to recompute
            assert t_spec.reused_tokens == t_plain.reused_tokens > 0, (turn, t_spec.line())
            assert t_spec.fresh_tokens == t_plain.fresh_tokens
        dec.check_integrity()
        ids = ids + a + prompt(6, seed=60 + turn)
    # a next prompt that does not hold the answer: the MTP cell of the last KV token is
    # rebuilt (it pairs that token's hidden with the next token), nothing more
    held = list(s_spec.tokens)
    other = [t for t in prompt(7, seed=99) if t != first[0]][:6]
    t = Timing()
    list(generate(s_spec, held + other, 1, GREEDY, 8, timing=t, spec=dec))
    assert t.reused_tokens == len(held) - 1


def test_release_restore_between_requests_keeps_output(model: Model) -> None:
    """The loan's order: release every decode resource, prefill-free gap, restore, decode."""
    dec = SpecDecoder.with_mtp(model, 4, draft_vocab=300)
    ids = prompt(18, seed=6)
    want, _, _ = spec_run(dec, model, ids, 20, 512)
    freed = [r.release() for r in dec.resources()]
    assert freed == [r.nbytes for r in dec.resources()] and all(freed)
    assert not any(r.resident for r in dec.resources())
    with pytest.raises(AssertionError, match="released"):
        spec_run(dec, model, ids, 20, 512)
    restored = [r.restore() for r in reversed(dec.resources())]
    assert restored == [r.nbytes for r in reversed(dec.resources())]
    dec.check_integrity()
    got, _, _ = spec_run(dec, model, ids, 20, 512)
    assert got == want


def test_runtime_entry_points_begin_collect_decode(model: Model) -> None:
    """A runtime prefills itself: begin -> chunks with collect -> decode, with a cancel."""
    dec = SpecDecoder.with_mtp(model, 4)
    ids = prompt(30, seed=12)
    want, _ = plain(model, ids, 30, 8)
    s = Session(model, 512)
    assert dec.draft.reusable(s, ids, 0) == 0
    dec.begin(s, 0)
    for a in range(0, len(ids), 8):  # what Session.prefill does per chunk, with the hook
        pos0 = len(s.tokens)
        res = s.forward(ids[a : a + 8], "last" if a + 8 >= len(ids) else "none")
        dec.collect(pos0, res.hidden)
    cancel = threading.Event()
    got = []
    for tok in dec.decode(s, res.logits, Sampler(GREEDY), 30, timing=Timing(), cancel=cancel):
        got.append(tok)
        if len(got) == 11:
            cancel.set()
    assert got == want[:11] and s.tokens == ids + got[:-1]
    dec.check_integrity()
    # without the prefill's hidden the MTP draft cannot start: a loud error, not bad drafts
    s2 = Session(model, 512)
    dec.begin(s2, 0)
    logits = s2.prefill(ids, 8)
    with pytest.raises(AssertionError, match="SpecDecoder.collect"):
        next(dec.decode(s2, logits, Sampler(GREEDY), 5))


def test_spec_window_must_be_2_to_8(model: Model) -> None:
    for bad in (1, 9, -2):
        with pytest.raises(FlagError, match=f"--spec {bad} must be 0"):
            SpecDecoder.with_mtp(model, bad)


# -- sampled decoding ------------------------------------------------------------------


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_positions_pick_follows_p_and_is_fixed_by_seed_and_position() -> None:
    """Over 40,000 positions the picks from one distribution follow it (Gumbel-max), the
    same (seed, position) picks the same token in any order, and another seed other ones."""
    p = np.array([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7)
    sampler, logits = Sampler(params), np.log(p).astype(np.float32)
    n = 40_000
    picks = np.array([sampler.sample(logits, pos) for pos in range(n)])
    assert chi_square(np.bincount(picks, minlength=p.size).astype(float), p) < CHI2_5DOF_P999
    q = np.array([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])  # the bound does discriminate
    assert chi_square(np.bincount(picks, minlength=p.size).astype(float), q) > 100 * CHI2_5DOF_P999
    backwards = [Sampler(params).sample(logits, pos) for pos in reversed(range(500))]
    assert backwards[::-1] == picks[:500].tolist()
    other = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=8))
    assert [other.sample(logits, pos) for pos in range(500)] != picks[:500].tolist()


def test_a_draft_from_a_near_distribution_is_mostly_the_targets_pick() -> None:
    """A draft picked with the same noise from q near p agrees with p's pick about as often
    as the two distributions overlap; from a far q, rarely."""
    p = np.array([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    near = np.array([0.28, 0.06, 0.26, 0.10, 0.19, 0.11])
    far = np.array([0.01, 0.45, 0.01, 0.01, 0.01, 0.51])
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3))
    target = [sampler.sample(np.log(p), pos) for pos in range(5000)]
    agree = {name: np.mean([sampler.sample(np.log(q), pos) == t for pos, t in enumerate(target)])
             for name, q in (("near", near), ("far", far))}
    assert agree["near"] > 0.9 and agree["far"] < 0.2, agree


def test_sampled_sources_accept_all_or_none(model: Model) -> None:
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)
    ids = prompt(15, seed=8)
    for source, want_all in ((TargetDraft(), True), (AdversarialDraft(), False)):
        dec = SpecDecoder(4, source, Verifier.for_model(model, 4))
        got, s, timing = spec_run(dec, model, ids, 30, 512, params=params)
        assert len(got) == 30 and timing.drafts_offered > 0
        if want_all:  # p and q differ only by batched-vs-single rounding
            assert timing.drafts_accepted >= timing.drafts_offered - 1
        else:
            assert timing.drafts_accepted == 0
        assert s.tokens == ids + got[:-1]
        again, _, _ = spec_run(dec, model, ids, 30, 512, params=params)
        assert again == got  # seeded: repeatable
        want, _ = plain(model, ids, 30, 512, params=params)
        assert got == want  # the seed's text, drafts accepted or not


@pytest.mark.parametrize("n_window", (2, 4))
def test_sampled_mtp_spec_equals_plain_sampled_decoding(model: Model, n_window: int) -> None:
    """At any temperature drafting changes the time, never the text a seed gives."""
    dec = SpecDecoder.with_mtp(model, n_window)
    dec.always = True
    for i, params in enumerate((SamplingParams(temperature=0.8, seed=5),
                                SamplingParams(temperature=1.2, top_k=0, top_p=0.9, seed=6))):
        ids = prompt(23, seed=40 + i)
        want, _ = plain(model, ids, 40, 7, params=params)
        got, _, timing = spec_run(dec, model, ids, 40, 7, params=params)
        assert got == want and timing.drafted_steps > 0


def test_sampled_mtp_decoding_runs_and_keeps_state(model: Model) -> None:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=2)
    dec = SpecDecoder.with_mtp(model, 3, draft_vocab=200)
    ids = prompt(9, seed=9)
    got, s, timing = spec_run(dec, model, ids, 25, 4, params=params)
    assert len(got) == 25 and all(0 <= t < model.hp.n_vocab for t in got)
    assert s.tokens == ids + got[:-1] and timing.drafts_offered > 0
    dec.check_integrity()


# -- benchmark command -----------------------------------------------------------------


def test_bench_spec_table(tiny_path: Path) -> None:
    rows = bench(
        tiny_path, parse_specs("0,2,3"), runs=2, max_new=12, prompt_tokens=6, params=GREEDY
    )
    assert [r.spec for r in rows] == [0, 2, 3]
    assert all(len(r.tok_s) == 2 and min(r.tok_s) > 0 for r in rows)
    assert all(r.same_as_plain for r in rows)
    assert rows[0].offered == 0 and rows[1].offered > 0 and rows[2].offered > rows[1].offered
    table = format_table(rows).splitlines()
    assert len(table) == 5 and table[0].startswith("| spec T | decode tok/s")
    assert table[2].startswith("| 0 |") and table[3].endswith("| yes |")
    with pytest.raises(FlagError):
        parse_specs("0,1")


def test_host_rows_slice_across_their_blocks() -> None:
    """The prompt's hidden stays in its prefill chunks' blocks; slices span them as one array."""
    from engine.speculative.decoder import HostRows

    whole = np.arange(2 * 23, dtype=np.float32).reshape(23, 2)
    rows = HostRows([whole[:10], whole[10:11], whole[11:]])
    assert rows.shape == (23, 2)
    for a, b in ((0, 23), (3, 9), (8, 15), (10, 11), (9, 12), (20, 23), (0, 5)):
        np.testing.assert_array_equal(rows[a:b], whole[a:b])
    head = rows.head(15)  # views of the first blocks, none joined
    assert head.shape == (15, 2) and len(head.blocks) == 3
    np.testing.assert_array_equal(head[0:15], whole[:15])
