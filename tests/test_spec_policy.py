"""The drafting policy: measured seconds per token decide between drafted and plain steps,
and a plain step's hidden row reaches the MTP draft before it next proposes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from drafts import AdversarialDraft

from engine.model.loader import Model, load_model
from engine.request.record import generate
from engine.request.sampler import SamplingParams
from engine.request.session import Session
from engine.speculative.decoder import SpecDecoder
from engine.speculative.policy import DRAFT, PLAIN, PROBE_SHARE, DraftPolicy
from engine.speculative.verifier import Verifier
from engine.trace.timing import Timing

GREEDY = SamplingParams()


def run_policy(policy: DraftPolicy, cost: dict[str, tuple[float, int]], steps: int) -> list[str]:
    """Drive `policy` with fixed (seconds, tokens) per step of each mode; the modes it chose."""
    modes = []
    for _ in range(steps):
        mode = DRAFT if policy.drafting() else PLAIN
        modes.append(mode)
        policy.measured(*cost[mode])
    return modes


def test_slow_drafts_give_way_to_plain_steps() -> None:
    # a drafted step: 30 ms for 1.2 tokens (25 ms/token); plain: 14 ms for 1 token
    modes = run_policy(DraftPolicy(), {DRAFT: (0.030, 1), PLAIN: (0.014, 1)}, 200)
    assert modes[:2] == [DRAFT] * 2 and modes[2:4] == [PLAIN] * 2  # first span, then a probe
    assert modes[4:132] == [PLAIN] * 128  # plain wins clearly: home, for a long first span
    assert modes[132:134] == [DRAFT] * 2  # drafts probed again, then every max_span steps
    assert modes.count(DRAFT) <= 6 and modes[-40:].count(DRAFT) <= 2


def test_useless_drafts_cost_little_from_the_second_request() -> None:
    """Drafts never accepted (the H200 at 8 GiB: a drafted step 42 ms for 1 token, a plain
    one 22.5 ms): finding out costs the first request of 128 tokens at most 3% over plain
    decoding, and each later one, going on from the last, as little."""
    cost = {DRAFT: (0.042, 1), PLAIN: (0.0225, 1)}

    def extra(modes: list[str]) -> float:  # time over an all-plain request
        return modes.count(DRAFT) * (0.042 - 0.0225) / (len(modes) * 0.0225)

    policy = DraftPolicy()
    first = run_policy(policy, cost, 128)
    assert extra(first) <= 0.03
    for _ in range(6):
        policy = DraftPolicy(prior=policy)
        assert extra(run_policy(policy, cost, 128)) <= 0.03


def test_good_drafts_keep_drafting() -> None:
    # 30 ms for 3 tokens (10 ms/token) beats 14 ms/token
    modes = run_policy(DraftPolicy(), {DRAFT: (0.030, 3), PLAIN: (0.014, 1)}, 200)
    assert modes.count(PLAIN) <= 4 * 6 and modes[-30:].count(DRAFT) >= 26


def test_a_modes_first_step_is_not_measured() -> None:
    p = DraftPolicy(first_span=2, probe=2)
    p.measured(5.0, 1)  # the first drafted step (a graph capture, say): not counted
    p.measured(0.010, 2)
    assert p.seconds_per_token(DRAFT) == pytest.approx(0.005)
    assert not p.drafting()  # probing plain now
    p.measured(9.0, 1)
    p.measured(0.020, 1)
    assert p.seconds_per_token(PLAIN) == pytest.approx(0.020) and p.drafting()


def test_always_drafts() -> None:
    modes = run_policy(DraftPolicy(always=True), {DRAFT: (1.0, 1), PLAIN: (0.001, 1)}, 50)
    assert modes == [DRAFT] * 50


# -- in the decoder ------------------------------------------------------------------------


class Scripted(DraftPolicy):
    """Drafts on the steps whose index is in `pattern` (cyclic): a fixed schedule."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern, self.i = pattern, 0

    def drafting(self) -> bool:
        return self.pattern[self.i % len(self.pattern)] == "d"

    def measured(self, seconds: float, tokens: int) -> None:
        self.i += 1

    def plain_ahead(self, rows: int = 0) -> int:
        n = 0
        while n < len(self.pattern) and self.pattern[(self.i + n) % len(self.pattern)] == "p":
            n += 1
        return n


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Model:
    return load_model(tiny_path)


def spec_generate(dec: SpecDecoder, model: Model, ids: list[int], max_new: int,
                  params: SamplingParams = GREEDY) -> tuple[list[int], Session, Timing]:
    s, timing = Session(model, n_ctx=512), Timing()
    return list(generate(s, ids, max_new, params, 8, timing=timing, spec=dec)), s, timing


def test_plain_steps_reach_the_mtp_draft_in_one_pass(model: Model) -> None:
    """Drafted and plain steps mixed: the text is plain decoding's, and after the request the
    MTP block has a cell for every kept position, equal to those of an always-drafting run."""
    ids = np.random.default_rng(7).integers(0, 1000, 19).tolist()
    ref = SpecDecoder.with_mtp(model, 3)
    ref.always = True
    want, s_ref, _ = spec_generate(ref, model, ids, 30)
    dec = SpecDecoder.with_mtp(model, 3)
    dec.new_policy = lambda: Scripted("dppdpppd")  # type: ignore[method-assign]
    got, s, timing = spec_generate(dec, model, ids, 30)
    plain_ids = list(generate(Session(model, n_ctx=512), ids, 30, GREEDY, 8))
    assert got == want == plain_ids
    assert 0 < timing.drafts_offered < 2 * 30
    assert 0 < timing.drafted_steps < timing.spec_steps  # plain steps are counted too
    assert f"({timing.drafted_steps} of {timing.spec_steps} steps drafted)" in timing.line()
    n = len(s.tokens)
    assert n == len(s_ref.tokens) and dec.draft.n_cells == ref.draft.n_cells == n
    a, b = dec.draft.kv.read(0, n), ref.draft.kv.read(0, n)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-3, rtol=0)
    dec.check_integrity()
    # the next turn reuses the whole conversation, as after an always-drafting request
    t2 = Timing()
    more = ids + got + [5, 6, 7]
    list(generate(s, more, 5, GREEDY, 8, timing=t2, spec=dec))
    assert t2.reused_tokens == n


def test_a_long_plain_span_defers_the_prompt_to_after_the_reply(model: Model) -> None:
    """A policy that will not draft for a long span: the MTP block does not read the prompt
    while the reply decodes; `settle` (after the reply's timing) catches it up on every kept
    position, with the cells an always-drafting run has."""
    ids = np.random.default_rng(11).integers(0, 1000, 40).tolist()
    ref = SpecDecoder.with_mtp(model, 3)
    ref.always = True
    want, s_ref, _ = spec_generate(ref, model, ids, 24)
    dec = SpecDecoder.with_mtp(model, 3)
    dec.new_policy = lambda: Scripted("p" * 40 + "d")  # type: ignore[method-assign]
    s, cells = Session(model, n_ctx=512), []
    for tok in generate(s, ids, 24, GREEDY, 8, spec=dec):
        cells.append(dec.draft.n_cells)
    assert cells[-1] == 0 and s.tokens[: len(ids)] == ids  # nothing read while decoding
    assert [*ids, *want][: len(s.tokens)] == s.tokens
    n = len(s.tokens)
    assert dec.draft.n_cells == ref.draft.n_cells == n == len(s_ref.tokens)  # settled
    for x, y in zip(dec.draft.kv.read(0, n), ref.draft.kv.read(0, n)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-3, rtol=0)
    dec.check_integrity()


def test_useless_drafts_are_mostly_skipped(model: Model) -> None:
    """Drafts that are never accepted cost more than they give: most steps run plain."""
    ids = np.random.default_rng(8).integers(0, 1000, 12).tolist()
    dec = SpecDecoder(4, AdversarialDraft(), Verifier.for_model(model, 4))
    got, _, timing = spec_generate(dec, model, ids, 80)
    assert got == list(generate(Session(model, n_ctx=512), ids, 80, GREEDY, 8))
    drafted_steps = timing.drafts_offered // 3
    assert drafted_steps < 40 and timing.drafts_accepted == 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejected_sampled_drafts_stop_within_the_probe_budget(model: Model, temperature: float) -> None:
    """At temperature 1.0 and 0.7 (top-k 40: the adversary's token is never picked) drafts are
    all rejected; the policy measures that as it does greedy and stops drafting: at most 8 of
    the 79 decode steps draft (its first span, then probes; 2 on this VM). The text is plain
    sampled decoding's for the seed."""
    params = SamplingParams(temperature=temperature, seed=11)
    ids = np.random.default_rng(12).integers(0, 1000, 12).tolist()
    dec = SpecDecoder(4, AdversarialDraft(), Verifier.for_model(model, 4))
    got, _, timing = spec_generate(dec, model, ids, 80, params)
    assert got == list(generate(Session(model, n_ctx=512), ids, 80, params, 8))
    assert timing.drafts_accepted == 0
    assert timing.drafted_steps <= 8 < timing.spec_steps, (timing.drafted_steps, timing.spec_steps)


class FailingVerifier(Verifier):
    """Raises on its `fail_at`-th window: a device error in the middle of a reply."""

    fail_at = 10**9

    def verify(self, session, window_ids):  # type: ignore[no-untyped-def]
        self.fail_at -= 1
        if self.fail_at == 0:
            raise RuntimeError("device lost")
        return super().verify(session, window_ids)


def test_an_error_after_plain_steps_leaves_a_usable_state(model: Model) -> None:
    """A failure after plain steps runs no more device work; the next request re-reads what
    the draft lacks and answers as plain decoding does."""
    ids = np.random.default_rng(9).integers(0, 1000, 15).tolist()
    base = SpecDecoder.with_mtp(model, 3)
    verifier = FailingVerifier.for_model(model, 3)
    dec = SpecDecoder(3, base.draft, verifier)
    dec.new_policy = lambda: Scripted("dpp")  # type: ignore[method-assign]
    verifier.fail_at = 6
    s = Session(model, n_ctx=512)
    with pytest.raises(RuntimeError, match="device lost"):
        list(generate(s, ids, 20, GREEDY, 8, spec=dec))
    assert dec.draft.n_cells <= len(s.tokens)
    verifier.fail_at = 10**9
    got = list(generate(s, ids, 20, GREEDY, 8, spec=dec))
    assert got == list(generate(Session(model, n_ctx=512), ids, 20, GREEDY, 8))
    dec.check_integrity()


def test_a_probe_waits_until_its_catch_up_is_a_small_share_of_plain_decoding() -> None:
    """A probe of drafting from a plain home first catches the draft model up over the rows it
    has not seen: with a 31k-token prompt waiting (0.02 ms a row: 0.63 s) and 20 ms plain steps
    it comes at the end of the first span past 0.63 / PROBE_SHARE = 21 s of plain time."""
    p = DraftPolicy()
    p.home = p.mode = PLAIN
    p.span = p.left = 256
    p.row_s = 2e-5
    waiting = [31_258]
    p.backlog = lambda: waiting[0]
    modes = run_policy(p, {DRAFT: (0.042, 1), PLAIN: (0.020, 1)}, 1400)
    first = modes.index(DRAFT)
    assert first == 5 * 256  # whole spans of plain steps: the first end past 21 s
    assert 0.020 * (first - 256) < 31_258 * 2e-5 / PROBE_SHARE <= 0.020 * first
    assert modes.count(DRAFT) == 2 and p.plain_s < 0.020 * 200  # counted again from the probe
    q = DraftPolicy()
    q.home = q.mode = PLAIN
    q.span = q.left = 256
    q.row_s, q.backlog = 2e-5, lambda: 300  # a short backlog: probed after the first span
    assert run_policy(q, {DRAFT: (0.042, 1), PLAIN: (0.020, 1)}, 260)[256:258] == [DRAFT] * 2


def test_the_catch_up_rate_is_measured_on_long_passes_only() -> None:
    p = DraftPolicy()
    p.caught_up(0.5, 10)  # too short to say what a row costs
    assert p.row_s is None and p.probe_cost() == 0.0
    p.caught_up(0.64, 32_000)
    p.backlog = lambda: 1000
    assert p.row_s == pytest.approx(2e-5) and p.probe_cost() == pytest.approx(0.02)
    assert DraftPolicy(prior=p).row_s == p.row_s  # the next request goes on from it


def test_a_prompt_whose_pass_a_probe_could_not_pay_is_deferred() -> None:
    """Plain steps ahead count the probe's price: a span that ends in 10 steps with a probe
    that could not pay for 2,048 more rows is a span longer (the decoder defers the prompt's
    pass and lends the draft model's memory for it)."""
    p = DraftPolicy()
    p.home = p.mode = PLAIN
    p.span, p.left, p.row_s, p.plain_s = 256, 10, 1e-4, 1.0
    p.backlog = lambda: 0
    assert p.plain_ahead() == 10  # nothing waits: the probe comes at the span's end
    assert p.plain_ahead(rows=2048) == 10 + 256  # 0.2 s > 3% of 1 s
    p.home = DRAFT  # probing plain from a drafting home: drafts again in 10 steps
    assert p.plain_ahead(rows=2048) == 10


def test_the_spec_vs_plain_script_runs_every_configuration() -> None:
    """scripts/spec_vs_plain.py (docs/spec-decoding.md), at a toy size: a row per
    configuration, greedy replies whatever the drafting does."""
    import importlib.util
    import sys

    path = Path(__file__).parent.parent / "scripts" / "spec_vs_plain.py"
    spec = importlib.util.spec_from_file_location("spec_vs_plain", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    results = mod.run("random-demo", 96, 12, 1)
    assert set(results) == set(mod.CONFIGS) and all(len(r) == 1 for r in results.values())
    assert all(tg > 0 for runs in results.values() for tg, _ in runs)
    table = mod.markdown(results)
    assert table.count("\n| ") == len(mod.CONFIGS) and "| no MTP |" in table
