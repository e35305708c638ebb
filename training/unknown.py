"""Words the dictionary does not hold: typos of real lemmas, made-up pronounceable strings and
common French, German and Spanish words, each answered "I don't know the word 'X'." with,
where a lemma is close (edit distance 1, or 2 for words of `LONG_WORD` letters or more), "Did
you mean 'Y'?" naming the most used such lemma (WordNet's tagged-sense counts).

A non-word is never a lemma (checked where it is made). About a tenth of all non-words (a
stable hash, `eval_only`) are kept for the evaluation set and never made for training. The
training set holds a typo of every everyday lemma of 4+ letters (`typo_cover`), then a seeded
mix of typos, made-up and foreign words up to its fixed count.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Iterator

from training.corpus import Pair
from training.wordnet import WordNet

LONG_WORD = 8  # letters from which a suggestion may be two edits away
EVAL_PER_MILLE = 100  # non-words kept for the evaluation set (by a stable hash)
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
ONSET_TEXT = "b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sc sh sk sl sm sn sp st"
ONSETS = tuple(ONSET_TEXT.split(" ")) + ("str", "sw", "t", "th", "tr", "v", "w", "wh", "z")
NUCLEUS_TEXT = "a e i o u ai au ea ee ie oa oo ou y"
NUCLEI = tuple(NUCLEUS_TEXT.split(" "))
CODAS = ["", "", "b", "ck", "d", "f", "g", "k", "l", "m", "n", "nd", "ng", "nk", "nt", "p", "r",
         "rk", "rt", "s", "sh", "st", "t", "th", "x", "z"]  # fmt: skip
# Everyday words of three languages, written for this project; those that are English lemmas
# too ('die', 'chat', 'pan', ...) are dropped where the list is used (`foreign_words`).
FOREIGN = """
bonjour merci bonsoir maison chien chat fromage voiture pomme soleil boulangerie fenetre
oiseau poisson chapeau jardin mouton lapin grenouille papillon cuillere fourchette couteau
assiette bouteille chemise chaussure montagne plage nuage arbre fleur travail ecole vendredi
samedi dimanche aujourd'hui demain toujours jamais beaucoup pourquoi comment combien
wasser danke bitte haus hund katze brot apfel schule freund freundin strasse fenster tisch
stuhl schmetterling kuchen zeitung fahrrad bahnhof krankenhaus gestern morgen heute immer
nichts vielleicht wunderbar schnell langsam gross klein warum wieviel entschuldigung fruhstuck
handschuh kuhlschrank regenschirm eichhornchen zwiebel kartoffel
hola gracias adios perro gato casa agua leche manzana naranja ciudad playa libro ventana
mesa silla cuchara tenedor cuchillo camisa zapato montana arbol flor trabajo escuela amigo
amiga hermano hermana abuelo ayer manana hoy siempre nunca mucho porque cuanto despacio
rapido biblioteca mariposa cerveza queso jamon tortuga sombrero almohada
"""


def eval_only(word: str) -> bool:
    """Whether `word` is kept for the evaluation set (never a training non-word)."""
    return zlib.crc32(word.lower().encode("utf-8")) % 1000 < EVAL_PER_MILLE


def edits1(word: str, alphabet: str = ALPHABET) -> set[str]:
    """Every string one deletion, swap of neighbours, substitution or insertion from `word`."""
    splits = [(word[:i], word[i:]) for i in range(len(word) + 1)]
    out = {a + b[1:] for a, b in splits if b}
    out |= {a + b[1] + b[0] + b[2:] for a, b in splits if len(b) > 1}
    out |= {a + c + b[1:] for a, b in splits if b for c in alphabet}
    out |= {a + c + b for a, b in splits for c in alphabet}
    out.discard(word)
    return out


def _deletes(word: str, n: int) -> set[str]:
    out, frontier = {word}, {word}
    for _ in range(n):
        frontier = {w[:i] + w[i + 1 :] for w in frontier for i in range(len(w))}
        out |= frontier
    return out


def distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance (Levenshtein plus swaps of neighbours)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


class Speller:
    """Suggestions from the lemma list: the most used lemma one edit away (any lemma), else,
    for a word of `LONG_WORD` letters or more, the most used one two edits away (among lemmas
    of WordNet's sense-tagged text: a rare lemma two edits off is no help)."""

    def __init__(self, wn: WordNet) -> None:
        self.lemmas = frozenset(wn.senses)
        self.tagged = wn.tagged
        self._alphabet = ALPHABET + "".join(sorted({c for w in wn.senses for c in w} - set(ALPHABET)))
        self._near: dict[str, list[str]] = {}  # a lemma's 0-2 deletions -> tagged lemmas
        for w, n in wn.tagged.items():
            if n and len(w) >= LONG_WORD - 2:
                for d in _deletes(w, 2):
                    self._near.setdefault(d, []).append(w)

    def is_lemma(self, word: str) -> bool:
        return word.lower() in self.lemmas

    def _best(self, words: Iterable[str]) -> str | None:
        return min(words, key=lambda w: (-self.tagged.get(w, 0), len(w), w), default=None)

    def suggest(self, word: str) -> str | None:
        """The lemma to name in "Did you mean 'Y'?", or None."""
        word = word.lower()
        best = self._best(e for e in edits1(word, self._alphabet) if e in self.lemmas)
        if best is not None or len(word) < LONG_WORD:
            return best
        found = {w for d in _deletes(word, 2) for w in self._near.get(d, ())}
        return self._best(w for w in found if w != word and distance(word, w) <= 2)


def reply(word: str, suggestion: str | None) -> str:
    """The answer to a word that is not a lemma."""
    text = f"I don't know the word '{word}'."
    return text + (f" Did you mean '{suggestion}'?" if suggestion else "")


def typo(lemma: str, rng: random.Random) -> str:
    """`lemma` with one deletion, swap, substitution or insertion (a letter), at random."""
    i = rng.randrange(len(lemma))
    op = rng.choice(("delete", "swap", "substitute", "insert"))
    c = rng.choice(ALPHABET)
    if op == "delete" and len(lemma) > 3:
        return lemma[:i] + lemma[i + 1 :]
    if op == "swap" and i + 1 < len(lemma):
        return lemma[:i] + lemma[i + 1] + lemma[i] + lemma[i + 2 :]
    if op == "substitute":
        return lemma[:i] + c + lemma[i + 1 :]
    return lemma[:i] + c + lemma[i:]


def pronounceable(rng: random.Random) -> str:
    """A made-up word of two or three syllables ('blorast', 'quenthik')."""
    return "".join(rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS)
                   for _ in range(rng.choice((2, 2, 3))))  # fmt: skip


def foreign_words(sp: Speller) -> list[str]:
    """The FOREIGN list less every word that is also an English lemma."""
    return sorted({w for w in FOREIGN.split() if not sp.is_lemma(w)})


def _typo_sources(wn: WordNet) -> list[str]:
    # everyday single words: the typos a user makes are of the words a user types
    return sorted(w for w, n in wn.tagged.items() if n and w.isalpha() and len(w) >= 4)


def nonwords(wn: WordNet, sp: Speller, n: int, rng: random.Random, for_eval: bool = False,
             seen: set[str] | None = None) -> Iterator[tuple[str, str]]:
    """`n` (non-word, how it was made) pairs, none a lemma: half typos of everyday lemmas
    and a third made-up words (each once), the rest foreign words (they repeat in training;
    in the evaluation set every word is another). `for_eval` draws from the
    evaluation share instead of the training one; `seen` holds words already made (and
    gets the new ones)."""
    sources, foreign = _typo_sources(wn), foreign_words(sp)
    seen = set() if seen is None else seen
    made = 0
    while made < n:
        r = rng.random()
        if r < 0.5 and sources:
            word, how = typo(rng.choice(sources), rng), "typo"
        elif r < 0.83:
            word, how = pronounceable(rng), "made-up"
        else:
            word, how = rng.choice(foreign), "foreign"
        # a foreign word may come back (there are ~100 of them; a typo or a made-up word
        # is met once)
        again = word in seen and (for_eval or how != "foreign")
        if again or sp.is_lemma(word) or eval_only(word) != for_eval:
            continue
        seen.add(word)
        made += 1
        yield word, how


TYPO_TRIES = 20  # random typos tried for a lemma before its one-edit strings are listed


def typo_cover(wn: WordNet, sp: Speller, rng: random.Random, seen: set[str],
               copies: int = 1) -> list[str]:
    """`copies` training typos of every everyday lemma of 4+ letters (the lemmas a user
    types), in lemma order: each a random deletion, swap, substitution or insertion that is no
    lemma, no evaluation word and not in `seen` (which gets it), else the first such string
    one edit away. Every such lemma has them: 4 letters give ~230 one-edit strings."""
    out = []
    for lemma in _typo_sources(wn):
        for _ in range(copies):
            tries = (typo(lemma, rng) for _ in range(TYPO_TRIES))
            word = next((w for w in tries if _trainable(w, sp, seen)), None)
            if word is None:
                word = next(w for w in sorted(edits1(lemma)) if _trainable(w, sp, seen))
            seen.add(word)
            out.append(word)
    return out


def _trainable(word: str, sp: Speller, seen: set[str]) -> bool:
    return word not in seen and not sp.is_lemma(word) and not eval_only(word)


def pairs(wn: WordNet, sp: Speller, n: int, rng: random.Random, templates: tuple[str, ...],
          typo_copies: int = 1) -> list[Pair]:
    """`n` training pairs about non-words, asked with `templates` (the dictionary's
    question forms, so a typo reads like any other question): `typo_copies` typos of every
    everyday lemma (`typo_cover`), then the seeded mix of `nonwords`. `n` is at least the
    cover."""
    seen: set[str] = set()
    cover = typo_cover(wn, sp, rng, seen, typo_copies)
    if n < len(cover):
        raise ValueError(f"{n} unknown-word exchanges cannot hold {typo_copies} typo(s) of "
                         f"each of the {len(cover) // typo_copies} everyday lemmas of 4+ letters")
    words = [(w, "typo") for w in cover] + list(nonwords(wn, sp, n - len(cover), rng, seen=seen))
    out = []
    for word, how in words:
        user = rng.choice(templates).format(w=word, W=word[:1].upper() + word[1:], a="a")
        out.append(Pair(user, reply(word, sp.suggest(word)), word, f"unknown-{how}"))
    return out
