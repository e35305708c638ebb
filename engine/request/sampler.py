"""Token sampling: greedy, or temperature with top-k and top-p, from a seeded generator.

`distribution()` is exposed because speculative decoding's rejection rule needs the target
and draft distributions, not only a sample.
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


def distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """logits [V] -> probabilities [V] float64 after temperature, top-k and top-p."""
    # NaN logits rank last and +inf first, so no probability below can be NaN
    z = np.nan_to_num(logits.astype(np.float64), nan=-np.inf, posinf=np.finfo(np.float64).max)
    if p.greedy:
        out = np.zeros_like(z)
        out[int(np.argmax(z))] = 1.0
        return out
    # the top logit is 0 before the division: a tiny temperature (1e-320) sends the others to
    # -inf, not inf - inf, and the distribution becomes the greedy one
    with np.errstate(over="ignore"):  # to -inf is the point
        z = (z - z.max()) / p.temperature
    if 0 < p.top_k < z.size:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z)  # [V], the top one exactly 1
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, p.top_p)) + 1]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return probs


class Sampler:
    """Draws tokens; one generator per request so seeded runs repeat exactly."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        return self.draw(distribution(logits, self.params))

    def draw(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(probs.size, p=probs))

    def uniform(self) -> float:
        return float(self.rng.random())
