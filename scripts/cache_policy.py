"""The expert-cache admission policy replayed on a model's real decode routing, at several cache
sizes (docs/expert-cache.md): `python -m scripts.cache_policy [--model demo] [--max-new 128]`.

Greedy replies to questions about words are generated once, one request after another on one engine
(the cache keeps its state between them, as in a chat), and every decode step's routing is
recorded. The routing is then replayed through `engine.experts.policy.Admission` for each
cache size, starting from the profile fill the engine starts from: `static` (no admission),
`adaptive` (the shipped rule) and `recency` (admit every miss, evict the least recently used:
the rule with no memory, no margin and no budget). Prints one markdown table: hit rate, experts
promoted and experts read over the link (misses + promotions) per token.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from engine.config import EngineOptions
from engine.experts.policy import Admission
from engine.experts.residency import ResidencyTable
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from engine.synth.vocab import word_list

FORMS = ("Define the word {}.", "What does {} mean?", "What is a {}?", "Tell me about {}.")
FRACTIONS = (0.10, 0.25, 0.50)
POLICIES = ("static", "adaptive", "recency")


@dataclass(frozen=True)
class Result:
    hits: int
    misses: int
    promoted: int

    @property
    def hit_pct(self) -> float:
        return 100.0 * self.hits / max(1, self.hits + self.misses)


def prompts(n: int, seed: int = 0) -> list[str]:
    """`n` questions about words of the embedded word list (fixed by `seed`)."""
    words = word_list()
    rng = np.random.default_rng(seed)
    return [FORMS[i % len(FORMS)].format(words[int(w)])
            for i, w in enumerate(rng.choice(len(words), size=n, replace=False))]


def record(model: str, max_new: int, questions: list[str]
           ) -> tuple[list[np.ndarray], list[tuple[int, int]], int, int]:
    """(per decode step int [L, T, k], the cache's fill order, n_layer, n_expert)."""
    loop = ServeLoop.create(EngineOptions(model=model, device="sim", ctx=4096,
                                          cache_policy="static"))
    steps: list[np.ndarray] = []
    session, be = loop.rt.session, loop.rt.backend
    session.on_step = lambda routes: steps.append(be.download(be.xp.stack(routes)))
    for p in questions:
        loop.chat(Conversation(), p, SamplingParams(), max_new=max_new)
    hp, cache = loop.rt.model.hp, loop.rt.cache
    fill = list(cache.order) if cache is not None else []
    loop.close()
    return steps, fill, hp.n_layer, hp.n_expert


def replay(steps: list[np.ndarray], fill: list[tuple[int, int]], n_layer: int, n_expert: int,
           n_slots: int, policy: str) -> Result:
    """Hits, misses and promotions of `policy` over `steps` from the first `n_slots` of `fill`."""
    table = ResidencyTable(n_layer, n_expert, n_slots)
    for slot, (layer, expert) in enumerate(fill[:n_slots]):
        table.assign(slot, layer, expert)
    adm = None
    if policy == "adaptive":
        adm = Admission(n_layer, n_expert, table.slot_of >= 0)
    elif policy == "recency":  # only this step counts; every miss goes in
        adm = Admission(n_layer, n_expert, table.slot_of >= 0, half_life=1e-3, budget=1 << 30,
                        margin=0.0, seed=0.0)
    hits = misses = promoted = 0
    replaceable = np.ones(n_slots, dtype=bool)
    for ids in steps:  # [L, T, k]
        layers = np.broadcast_to(np.arange(n_layer)[:, None, None], ids.shape)
        resident = table.slot_of[layers, ids] >= 0
        hits += int(resident.sum())
        misses += int((~resident).sum())
        if adm is None:
            continue
        for m in adm.step(ids, table.slot_of, table.owner_of, replaceable):
            table.evict(m.slot)
            table.assign(m.slot, m.layer, m.expert)
            promoted += 1
    return Result(hits, misses, promoted)


def markdown(steps: list[np.ndarray], fill: list[tuple[int, int]], n_layer: int,
             n_expert: int, fractions: tuple[float, ...] = FRACTIONS) -> str:
    n_tok = sum(s.shape[1] for s in steps)
    lines = [f"{n_tok} decode tokens, {n_layer} x {n_expert} experts",
             "", "| cache (experts) | policy | hits | promoted / token | link reads / token |",
             "|---|---|---:|---:|---:|"]
    for frac in fractions:
        n_slots = max(1, round(frac * n_layer * n_expert))
        for policy in POLICIES:
            r = replay(steps, fill, n_layer, n_expert, n_slots, policy)
            lines.append(f"| {n_slots} ({100 * frac:.0f}%) | {policy} | {r.hit_pct:.1f}% | "
                         f"{r.promoted / n_tok:.2f} | {(r.misses + r.promoted) / n_tok:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=48, help="questions, one request each")
    args = ap.parse_args(argv)
    print(markdown(*record(args.model, args.max_new, prompts(args.prompts))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
