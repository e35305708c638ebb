"""The sampler against its definition over the whole vocabulary: temperature, top-k (ties at
the k-th kept), top-p (the most likely first, ties by token id). The sampler works on the
top-k candidates only and picks by Gumbel-max; these tests hold its probabilities to the
whole-vocabulary definition and its picks over many positions to those probabilities."""

from __future__ import annotations

import numpy as np
import pytest

from engine.request.sampler import Sampler, SamplingParams, distribution, support


def reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The definition, over all V tokens: probabilities [V] float64."""
    z = np.nan_to_num(logits.astype(np.float64), nan=-np.inf, posinf=np.finfo(np.float64).max)
    if p.greedy:
        out = np.zeros_like(z)
        out[int(np.argmax(z))] = 1.0
        return out
    with np.errstate(over="ignore"):
        z = (z - z.max()) / p.temperature
    if 0 < p.top_k < z.size:
        z = np.where(z < np.sort(z)[-p.top_k], -np.inf, z)
    probs = np.exp(z)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return probs


def cases(n: int) -> list[tuple[np.ndarray, SamplingParams]]:
    """Seeded logits (some with NaN, +inf, or rounded to integers so that values tie) and
    settings of every filter, over small and Qwen-sized vocabularies."""
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        v = (50, 1024, 151_936)[i % 3]
        x = (rng.standard_normal(v) * rng.uniform(0.5, 8)).astype(np.float32)
        if i % 7 == 0:
            x[rng.integers(v, size=3)] = np.nan
        if i % 11 == 0:
            x[rng.integers(v)] = np.inf
        if i % 5 == 0:
            x = np.round(x)  # many ties, at the k-th value too
        params = SamplingParams(
            temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5])),
            top_k=int(rng.choice([0, 1, 5, 40, v + 3])),
            top_p=float(rng.choice([1.0, 0.95, 0.5])),
            seed=i,
        )
        out.append((x, params))
    return out


@pytest.mark.parametrize("i", range(90))
def test_distribution_is_the_definition(i: int) -> None:
    x, params = cases(90)[i]
    want, got = reference(x, params), distribution(x, params)
    np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    ids, probs = support(x, params)
    assert np.all(np.diff(ids) > 0) and np.all(probs > 0)
    np.testing.assert_array_equal(got[ids], probs)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=1),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.9, seed=2),
    SamplingParams(temperature=1.5, top_k=8, top_p=1.0, seed=3),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=4),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_picks_over_positions_follow_the_definition(params: SamplingParams) -> None:
    """The Gumbel-max picks of 20,000 positions from one row's logits are drawn from the
    definition's distribution: a chi-square over the kept tokens (the rare ones pooled)."""
    x = (np.random.default_rng(9).standard_normal(1024) * 1.5).astype(np.float32)
    x[[3, 4]] = x.max()  # a tie at the top
    x[7] = np.nan
    want = reference(x, params)
    sampler = Sampler(params)
    picks = np.array([sampler.sample(x, pos) for pos in range(20_000)])
    assert set(np.unique(picks)) <= set(np.flatnonzero(want).tolist())
    counts = np.bincount(picks, minlength=x.size).astype(float)
    common = want * picks.size >= 20  # cells with an expected count of at least 20
    obs = np.append(counts[common], counts[~common].sum())
    exp = np.append(want[common], want[~common].sum()) * picks.size
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.size - 1
    assert dof >= 1 and chi2 < dof + 5 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_top_k_keeps_every_tie_with_the_kth_value() -> None:
    x = np.array([3.0, 1.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    ids, probs = support(x, SamplingParams(temperature=1.0, top_k=2, top_p=1.0))
    assert ids.tolist() == [0, 2, 3, 4]  # the 2nd largest value, 2.0, three times
    np.testing.assert_allclose(probs.sum(), 1.0)


def test_a_wide_nucleus_is_found_past_the_first_candidates() -> None:
    """top-p over a flat distribution keeps thousands of tokens: the nucleus search grows
    past its first 64 candidates and still cuts where the sorted mass reaches top_p."""
    x = np.random.default_rng(1).standard_normal(151_936).astype(np.float32) * 0.5
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.9)
    want = reference(x, params)
    ids, probs = support(x, params)
    assert ids.size == np.count_nonzero(want) > 10_000
    np.testing.assert_allclose(probs, want[ids], rtol=1e-12)


def test_greedy_support_is_the_argmax() -> None:
    x = np.array([0.1, 5.0, 5.0, -1.0], dtype=np.float32)
    ids, probs = support(x, SamplingParams())
    assert ids.tolist() == [1] and probs.tolist() == [1.0]
    assert Sampler(SamplingParams()).sample(x, 0) == 1


def test_bench_sampler_prints_a_row_per_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    assert main(["bench-sampler", "--vocab", "5000", "--runs", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| T ")]
    assert len(rows) == 4 and "(default)" in rows[0]
    assert main(["bench-sampler", "--vocab", "1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
