"""The training set as multi-turn chats: every exchange of the corpus (dictionary pairs, the
persona, unknown words, long pastes) in a seeded order, cut into conversations.

A quarter of the conversations are one exchange (the app's first message); the rest have
3-9, so a question is asked after 2-8 earlier exchanges about other words, and
`PASTE_SHARE` of them hold a long pasted text somewhere (its own turn, answered as a paste).
Every reply depends on its own question only (a dictionary answers the same whatever came
before), so the model learns to answer the last question whatever the history holds.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from training import corpus, persona, unknown
from training.corpus import Pair
from training.pastes import PasteMaker
from training.wordnet import WordNet

Conversation = tuple[Pair, ...]


@dataclass(frozen=True)
class Mix:
    """How much of each kind of exchange, and how they are cut into conversations."""

    # non-word exchanges, a fixed count (a share of the dictionary pairs fell with them):
    # `typo_copies` typos of each of the 16,319 everyday lemmas of 4+ letters, then the
    # seeded mix (run 5, one typo a lemma and 40,000 in all: typos of everyday words were
    # still defined as real words, 70% of non-words said unknown)
    n_unknown: int = 64_000
    typo_copies: int = 2
    persona_each: int = 2300  # exchanges of each kind of persona message (12 kinds): 6%
    single_share: float = 0.25  # conversations of one exchange
    min_turns: int = 3  # the others: 2-8 earlier exchanges, then the last question
    max_turns: int = 9
    paste_share: float = 0.025  # conversations holding one long pasted text (15% of tokens at 0.04)
    paste_chars: tuple[int, int] = (400, 10_000)  # log-uniform: ~100 to ~2,500 tokens


def norm(text: str) -> str:
    """A user message compared loosely: lower case, every run of punctuation and spaces one
    space ("Hey, what's up?" and "hey what s up" are one message)."""
    return " ".join(re.sub(r"[\W_]+", " ", text.lower()).split())


PERSONA_ASKS = frozenset(norm(m) for asks in persona.MESSAGES.values() for m in asks)


def suggestable(wn: WordNet) -> list[tuple[str, tuple[str, ...]]]:
    """(lemma, the kinds of question the corpus answers about it) for the everyday training
    lemmas a reply may suggest."""
    return [(w, corpus.answerable(wn, w)) for w in corpus.lemmas(wn, "train")
            if wn.tagged.get(w) and w.isalpha() and len(w) >= 3 and norm(w) not in PERSONA_ASKS]


def exchanges(wn: WordNet, seed: int, mix: Mix = Mix(), speller: unknown.Speller | None = None
              ) -> list[Pair]:
    """Every single exchange of the training set but the pastes, phrased with `seed`. A
    dictionary question that reads as a persona message ('hello', 'help') is left to the
    persona: one message, one kind of answer."""
    rng = random.Random(seed)
    words = [p for p in corpus.pairs(wn, "train", seed) if norm(p.user) not in PERSONA_ASKS]
    sp = speller or unknown.Speller(wn)
    odd = unknown.pairs(wn, sp, mix.n_unknown, rng, corpus.DEFINE, mix.typo_copies)
    people = persona.pairs(suggestable(wn), mix.persona_each, rng)
    return words + odd + people


def assemble(items: Sequence[Pair], pastes: PasteMaker, seed: int, mix: Mix = Mix()
             ) -> list[Conversation]:
    """`items` in a seeded order cut into conversations, pastes put into some of them."""
    rng = random.Random(seed)
    order = list(items)
    rng.shuffle(order)
    out: list[Conversation] = []
    i = 0
    while i < len(order):
        n = 1 if rng.random() < mix.single_share else rng.randint(mix.min_turns, mix.max_turns)
        turns = order[i : i + n]
        i += n
        if rng.random() < mix.paste_share:
            turns.insert(rng.randrange(len(turns) + 1), pastes.pair(rng, *mix.paste_chars))
        out.append(tuple(turns))
    return out


def build(wn: WordNet, seed: int, mix: Mix = Mix(), speller: unknown.Speller | None = None,
          pastes: PasteMaker | None = None) -> list[Conversation]:
    """The training conversations of one phrasing (`seed`): deterministic for a seed."""
    items = exchanges(wn, seed, mix, speller)
    return assemble(items, pastes or PasteMaker(wn), seed, mix)
