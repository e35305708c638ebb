"""Expert-cache admission while decoding (`--cache-policy adaptive`): frequency with recency.

The cache starts filled in profile order (most used first) and, under `static`, stays so. Under
`adaptive` every decode step's routing updates a score per (layer, expert): every score decays
by half each `half_life` steps and each routed (layer, expert) adds 1, so a score is a
frequency that forgets (recently and often used experts score high). Experts resident at the
start are seeded with `seed` so that one use of a miss cannot push them out at once.

After a step, at most `budget` of the step's misses, highest score first, are admitted: each
takes an empty slot, else the resident expert with the lowest score when its own score is
higher by at least `margin`. The budget and the margin keep the promotions (one upload of a
blob each, over the same link the misses are read over) a small share of the misses: a
promotion pays only when the expert is read again before it leaves.

Measured on the shipped demo model's routing (docs/expert-cache.md, `python -m
scripts.cache_policy`): with a quarter of the experts cached the hit rate goes from 35% to 42%
at 0.4 promotions a token, and the experts read over the link (misses + promotions) fall 7%;
LRU (admit every miss) hits as often and reads twice as much.

`--cache-policy auto` (the default) runs this rule on CUDA only: on the simulated device the
array ops keep hits and misses decoded alike, so a promotion only adds work
(engine/devices.py, `cache_policy`).

Pure: the cache (`ExpertCache.promote`) does the uploads this module chooses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HALF_LIFE_STEPS = 64
BUDGET = 2  # admissions a step at most
MARGIN = 1.0  # an admitted expert's score is at least this much above its victim's
SEED = 2.0  # the score of the experts resident at the start


@dataclass(frozen=True)
class Move:
    """Put (layer, expert) into `slot` (evicting what it holds, if anything)."""

    slot: int
    layer: int
    expert: int


class Admission:
    """Scores [n_layer, n_expert] and the admission rule (see the module docstring)."""

    def __init__(self, n_layer: int, n_expert: int, resident: np.ndarray, *,
                 half_life: float = HALF_LIFE_STEPS, budget: int = BUDGET,
                 margin: float = MARGIN, seed: float = SEED):
        assert resident.shape == (n_layer, n_expert) and resident.dtype == bool, resident.shape
        assert half_life > 0 and budget >= 0 and margin >= 0, (half_life, budget, margin)
        self.n_layer, self.n_expert = n_layer, n_expert
        self.decay = 0.5 ** (1.0 / half_life)
        self.budget, self.margin = budget, margin
        self.score = np.where(resident, seed, 0.0)  # [L, E] float64

    def ranking(self, order: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Every (layer, expert) of `order` (the cache's fill order), highest score first;
        equal scores keep their place in `order` (what decoding has not used yet stays in
        profile order)."""
        if not order:
            return []
        layer, expert = np.asarray(order, dtype=np.int64).T  # [n] each
        by_score = np.argsort(-self.score[layer, expert], kind="stable")  # [n]
        return [order[i] for i in by_score.tolist()]

    def step(self, routes: np.ndarray, slot_of: np.ndarray, owner_of: np.ndarray,
             replaceable: np.ndarray) -> list[Move]:
        """Count one decode step's routing and choose its admissions.

        routes: int [n_layer, T, k] (the step's T rows); slot_of: int [L, E] (-1: not
        resident); owner_of: int [n_slots, 2] ((-1, -1): empty); replaceable: bool [n_slots]
        (False for a slot the prompt path holds)."""
        n_layer, n_expert = self.score.shape
        assert routes.ndim == 3 and routes.shape[0] == n_layer, routes.shape
        layers = np.broadcast_to(np.arange(n_layer)[:, None, None], routes.shape).reshape(-1)
        experts = routes.reshape(-1).astype(np.int64)  # [L*T*k]
        self.score *= self.decay
        np.add.at(self.score, (layers, experts), 1.0)
        if self.budget == 0 or not replaceable.any():
            return []
        missed = slot_of[layers, experts] < 0  # [L*T*k]
        flat = np.unique(layers[missed] * n_expert + experts[missed])  # [n_missed] (layer, expert)
        if not len(flat):
            return []
        wanted = flat[np.argsort(-self.score.reshape(-1)[flat], kind="stable")][: self.budget]
        held = owner_of[:, 0] >= 0  # [n_slots]
        victim = np.where(held, self.score[owner_of[:, 0], owner_of[:, 1]], -np.inf)  # [n_slots]
        victim[~replaceable] = np.inf
        moves: list[Move] = []
        for c in wanted.tolist():
            layer, expert = divmod(c, n_expert)
            slot = int(np.argmin(victim))
            if victim[slot] == np.inf or self.score[layer, expert] < victim[slot] + self.margin:
                break  # candidates come best first: no later one would pass
            moves.append(Move(slot, layer, expert))
            victim[slot] = np.inf  # taken this step
        return moves
