"""Token sampling: greedy, or temperature with top-k and top-p, from a seeded generator.

`distribution()` is exposed because speculative decoding's rejection rule needs the target
and draft distributions, not only a sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import FlagError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise FlagError(f"--temperature {self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise FlagError(f"--top-k {self.top_k} must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise FlagError(f"--top-p {self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """logits [V] -> probabilities [V] float64 after temperature, top-k and top-p."""
    z = logits.astype(np.float64)
    if p.greedy:
        out = np.zeros_like(z)
        out[int(np.argmax(z))] = 1.0
        return out
    z = z / p.temperature
    if 0 < p.top_k < z.size:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
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
