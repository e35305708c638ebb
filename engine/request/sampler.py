"""Token sampling: greedy, or temperature with top-k and top-p, fixed by a seed and the
position.

A sampled token is a Gumbel-max draw: among the tokens the filters keep (`support`), the one
with the largest p / E, where E is a standard exponential computed from (seed, position,
token id) by a counter-based hash (splitmix64). That is a draw from p, and the token at a
position depends on that position's distribution and the seed only, not on what was drawn
before nor on how the steps were grouped: speculative decoding accepts a draft exactly when
it is the token plain decoding would pick (a draft made with the same noise agrees with it
often when the draft model's q is near p), so a seed gives the same text with drafts or
without, whatever the drafting policy decides (issue 32).

`distribution()` is exposed for what wants the whole [V] probabilities (tests, the bench).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import FlagError

MAX_SEED = 2**64 - 1  # numpy's generators take any size; OpenAI's seed is an int64


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shown(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 24 else text[:24] + "..."


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not _real(t) or not math.isfinite(t) or t < 0:
            problems.append(f"--temperature {_shown(t)} must be a finite number >= 0 (0 is "
                            "greedy)")
        if not _integer(k) or k < 0:
            problems.append(f"--top-k {_shown(k)} must be an integer >= 0 (0 disables it)")
        if not _real(p) or not 0 < p <= 1:  # NaN fails the comparison
            problems.append(f"--top-p {_shown(p)} must be a number in (0, 1]")
        if not _integer(seed) or not 0 <= seed <= MAX_SEED:
            problems.append(f"--seed {_shown(seed)} must be an integer in 0..2**64-1")
        if problems:
            raise FlagError(problems)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def support(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """logits [V] -> (ids [n] int64 ascending, probs [n] float64 summing to 1): the tokens
    that keep a probability after temperature, top-k and top-p, and those probabilities.

    Top-k is found in one O(V) partition of the float32 logits, so everything after it works
    on the k candidates (ties at the k-th value included), not on the whole vocabulary: a
    151,936-token vocabulary samples in about 0.5 ms instead of 11 (`strata bench-sampler`)."""
    x = np.asarray(logits)
    if p.greedy:
        return np.array([int(np.argmax(x))], dtype=np.int64), np.ones(1)
    if np.isnan(x).any():  # NaN logits rank last, as -inf
        x = np.where(np.isnan(x), -np.inf, x)
    if 0 < p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        ids = np.flatnonzero(x >= kth)  # [n >= k] the top k and any tie with the k-th
        x = x[ids]
    else:
        ids = None  # every token
    z = x.astype(np.float64)
    top = np.isposinf(z)
    if top.any():  # +inf ranks first and shares the mass with its equals
        z[top] = np.finfo(np.float64).max
    # the top logit is 0 before the division: a tiny temperature (1e-320) sends the others to
    # -inf, not inf - inf, and the distribution becomes the greedy one
    with np.errstate(over="ignore"):  # to -inf is the point
        z -= z.max()
        z /= p.temperature
    probs = np.exp(z, out=z)  # [n], the top one exactly 1
    probs /= probs.sum()
    if p.top_p < 1.0:
        keep = _nucleus(probs, p.top_p)
        probs = probs[keep] / probs[keep].sum()
    elif probs.all():
        keep = np.arange(probs.size)
    else:  # what the temperature sent to 0 is no candidate
        keep = np.flatnonzero(probs)
        probs = probs[keep]
    return (keep if ids is None else ids[keep]), probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Positions (ascending) of the most likely entries of probs [n] whose mass first reaches
    `top_p`, ties ordered by position: a sort of the `m` largest (ties with the m-th
    included), m growing x8 from 64 until their mass reaches top_p, not of all n."""
    m = 64
    while True:
        if m < probs.size:
            cut = np.partition(probs, -m)[-m]
            cand = np.flatnonzero(probs >= cut)  # [>= m] ascending
        else:
            cand = np.flatnonzero(probs)
        order = cand[np.argsort(-probs[cand], kind="stable")]  # most likely first
        cum = np.cumsum(probs[order])
        n_keep = int(np.searchsorted(cum, top_p)) + 1
        if n_keep <= order.size or m >= probs.size:
            return np.sort(order[:n_keep])
        m *= 8


def distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """logits [V] -> probabilities [V] float64 after temperature, top-k and top-p (`support`
    scattered into the vocabulary)."""
    ids, probs = support(logits, p)
    out = np.zeros(np.asarray(logits).size, dtype=np.float64)
    out[ids] = probs
    return out


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2**64)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def exponentials(seed: int, pos: int, ids: np.ndarray) -> np.ndarray:
    """Standard exponential noise [n] float64 for tokens `ids` [n] at position `pos`: a pure
    function of (seed, pos, id), the same wherever and however often it is asked."""
    key = np.uint64(_mix((seed ^ _mix((pos + 1) * _GOLDEN & _MASK)) & _MASK))
    h = ids.astype(np.uint64) * np.uint64(_GOLDEN) ^ key  # [n], wraps mod 2**64
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # (0, 1)
    return -np.log(u)


class Sampler:
    """Picks the token at a position from its logits: greedy, or the Gumbel-max draw that
    (seed, position) fix (the module's docstring)."""

    def __init__(self, params: SamplingParams):
        self.params = params

    def sample(self, logits: np.ndarray, pos: int) -> int:
        """The token at position `pos` (the index it will hold in the sequence) from the
        logits [V] that predict it."""
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, probs = support(logits, self.params)
        return int(ids[int(np.argmax(probs / exponentials(self.params.seed, pos, ids)))])
