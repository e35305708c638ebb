"""WordNet as chat pairs: definitions, kinds (hypernyms), synonyms, antonyms, examples.

A lemma's reply always uses its first sense (the most used one): teaching a model this small
the other senses too made it mix them (asked about 'dog', it answered a later sense).

Every pair is (user message, assistant reply). The replies are the dictionary's own words, so a
model trained on them answers in real English and, being a dictionary, predictably: what an
MTP head needs to draft well. About five percent of lemmas (rare ones, by a hash of the
lemma, so the split is the same on every machine) are held out of every pair whose subject
they are.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from training.wordnet import POS_NAMES, Synset, WordNet

HOLDOUT_PER_MILLE = 58  # of the rare lemmas: about 5% of all lemmas
# Definitions are what a user asks most: each is phrased twice an epoch, four times for the
# lemmas that occur in WordNet's sense-tagged text (~21k everyday words: dog, house, hello).
DEFINE_COPIES, COMMON_DEFINE_COPIES = 2, 4
# A kind question ("What is a cat?") is what a new user asks next, and run 4 (one phrasing an
# epoch) got about half the everyday nouns right: twice an epoch.
KIND_COPIES = 2
MAX_SYNONYMS = 6
# Kinds and synonyms are asked of everyday words (WordNet's sense-tagged text); for the ~100k
# rare lemmas the training minutes go to their definitions. (With every kind of pair for every
# lemma, conversations and pastes, a 6.5-minute build saw each definition 7 times and held 42%
# of training definitions; the single-pair demo saw them 11 times and held 78%.)
KINDS = ("define", "kind", "synonym", "antonym", "example")  # the dictionary pairs

DEFINE = (
    "What does '{w}' mean?", "What does {w} mean?", "what does {w} mean", "Define {w}.",
    "define {w}", "What is the meaning of '{w}'?", "Meaning of {w}?", "{w}", "{w}?",
    "What's the definition of {w}?", "Tell me what {w} means.", "{W}",
)  # fmt: skip
KIND = ("What is {a} {w}?", "what is {a} {w}", "What kind of thing is {a} {w}?", "What's {a} {w}?")
SYNONYM = (
    "A word like '{w}'?", "Another word for {w}?", "Synonyms of {w}?",
    "What's a synonym for '{w}'?", "words like {w}",
)  # fmt: skip
ANTONYM = ("What is the opposite of '{w}'?", "Opposite of {w}?", "Antonym of {w}?")
EXAMPLE = ("Use '{w}' in a sentence.", "Give an example with '{w}'.", "Example of {w}?")


@dataclass(frozen=True)
class Pair:
    user: str
    reply: str
    lemma: str
    kind: str  # define kind synonym antonym example


def held_out(wn: WordNet, lemma: str) -> bool:
    """Whether `lemma` is held out (the same on every machine): 5.8% of the lemmas outside
    WordNet's sense-tagged text, about 5% of all, so the shipped model knows every everyday
    word and is measured on rare ones it never saw as a subject."""
    if wn.tagged.get(lemma, 0):
        return False
    return zlib.crc32(lemma.lower().encode("utf-8")) % 1000 < HOLDOUT_PER_MILLE


def sense_line(lemma: str, s: Synset, with_example: bool = True) -> str:
    """'river (noun): a large natural stream of water (larger than a creek); 'the river ...''"""
    line = f"{lemma} ({POS_NAMES[s.pos]}): {s.definition}"
    if with_example and s.examples:
        line += f"; '{s.examples[0]}'"
    return line


def distinct(words: list[str], asked: str) -> list[str]:
    """`words` in order without repeats (ignoring case) and without the asked word itself:
    a synonym or kind list never repeats a word and never names the word asked about."""
    seen, out = {asked.lower()}, []
    for w in words:
        if w.lower() not in seen:
            seen.add(w.lower())
            out.append(w)
    return out


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text[-1:] in ".!?" else text + "."


def _ask(templates: tuple[str, ...], lemma: str, rng: random.Random) -> str:
    t = rng.choice(templates)
    return t.format(w=lemma, W=lemma[:1].upper() + lemma[1:], a=_article(lemma))


def pairs_for(wn: WordNet, lemma: str, rng: random.Random) -> Iterator[Pair]:
    """Every pair whose subject is `lemma` (one phrasing of each, drawn from `rng`): its
    definitions, its kind and synonyms if it is an everyday word, its antonym and example."""
    first = wn.synsets[wn.senses[lemma][0]]
    everyday = bool(wn.tagged.get(lemma, 0))
    for _ in range(COMMON_DEFINE_COPIES if everyday else DEFINE_COPIES):
        yield Pair(_ask(DEFINE, lemma, rng), sense_line(lemma, first), lemma, "define")
    if everyday:
        chain = kinds_of(wn, lemma)
        if chain:
            kinds = chain[0] + (f", itself a kind of {chain[1]}" if len(chain) > 1 else "")
            reply = f"{_article(lemma).capitalize()} {lemma} is a kind of {kinds}."
            for _ in range(KIND_COPIES):
                yield Pair(_ask(KIND, lemma, rng), reply, lemma, "kind")
        words = synonyms(wn, lemma)
        reply = (f"Words like '{lemma}': {', '.join(words)}." if words else
                 f"WordNet gives no other word for '{lemma}'.")
        yield Pair(_ask(SYNONYM, lemma, rng), reply, lemma, "synonym")
    found = opposite(wn, lemma)
    if found:
        word, target = found
        reply = f"The opposite of '{lemma}' is '{word}': {target.definition}."
        yield Pair(_ask(ANTONYM, lemma, rng), reply, lemma, "antonym")
    if first.examples:
        yield Pair(_ask(EXAMPLE, lemma, rng), _sentence(first.examples[0]), lemma, "example")


def kinds_of(wn: WordNet, lemma: str) -> list[str]:
    """The first two hypernyms of `lemma`'s first sense if it is a noun ('cat' -> feline,
    carnivore), without repeats or the lemma itself; [] for other parts of speech."""
    first = wn.synsets[wn.senses[lemma][0]]
    if first.pos != "n":
        return []
    chain, s = [], first
    while s.hypernyms and len(chain) < 2:
        s = wn.synsets[("n", s.hypernyms[0])]
        chain.append(s.lemmas[0])
    return distinct(chain, lemma)


def synonyms(wn: WordNet, lemma: str) -> list[str]:
    """Other words for `lemma`'s first sense: its synset's lemmas and the heads of its
    similar adjectives, at most MAX_SYNONYMS."""
    first = wn.synsets[wn.senses[lemma][0]]
    similar = [wn.synsets[("a", o)].lemmas[0] for o in first.similar]
    return distinct(first.lemmas + similar, lemma)[:MAX_SYNONYMS]


def opposite(wn: WordNet, lemma: str) -> tuple[str, Synset] | None:
    """(the antonym, its synset) of `lemma`'s first sense, or None where WordNet has none."""
    first = wn.synsets[wn.senses[lemma][0]]
    if not first.antonyms:
        return None
    off, idx = first.antonyms[0]
    target = wn.synsets[(first.key[0], off)]
    return target.lemmas[min(idx, len(target.lemmas) - 1)], target


def answerable(wn: WordNet, lemma: str) -> tuple[str, ...]:
    """The kinds of question (of KINDS) the corpus answers about `lemma` with real content:
    a definition always, a kind and synonyms for everyday words that have them, an antonym
    and an example where WordNet gives one. A suggestion names only these."""
    first = wn.synsets[wn.senses[lemma][0]]
    everyday = bool(wn.tagged.get(lemma, 0))
    has = {
        "define": True,
        "kind": everyday and bool(kinds_of(wn, lemma)),
        "synonym": everyday and bool(synonyms(wn, lemma)),
        "antonym": opposite(wn, lemma) is not None,
        "example": bool(first.examples),
    }
    return tuple(k for k in KINDS if has[k])


def lemmas(wn: WordNet, split: str) -> list[str]:
    """Lemmas of the 'train' or 'heldout' split, in a fixed order."""
    want = split == "heldout"
    return sorted(w for w in wn.senses if held_out(wn, w) == want)


def pairs(wn: WordNet, split: str, seed: int) -> list[Pair]:
    """All pairs of a split, phrased with `seed`."""
    rng = random.Random(seed)
    return [p for w in lemmas(wn, split) for p in pairs_for(wn, w, rng)]
