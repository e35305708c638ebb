"""The four acceptance measures of issue 29: their question sets (seeded, built from WordNet)
and their scores (pure functions of the replies, tested without a model).

1. Definitions: 200 held-out and 200 training lemmas, "What does 'X' mean?" alone; a reply
   scores when it holds the first content word of X's first gloss.
2. The same questions as the 4th turn, after two other words' exchanges and one pasted text
   of about 2,000 tokens (their replies the corpus's own); the score is compared to 1's.
3. 50 greetings and out-of-scope requests (`eval_persona.txt`, never trained on): a reply
   scores when it says what the model is or suggests a dictionary question, and fails when it
   is a definition ('X (noun): ...').
4. 100 non-words and typos (from the evaluation share, never trained on): a reply scores when
   it says it does not know the word; where a lemma is one edit away, the "Did you mean" must
   name a lemma one edit away.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from training import corpus, pastes, unknown
from training.wordnet import WordNet

PERSONA_FILE = Path(__file__).with_name("eval_persona.txt")
QUESTION = "What does '{w}' mean?"
STOP_WORDS = (
    "a an the of or and to in on by for as at with from that which who any some one its it "
    "be is are being having has have not no into out up usually especially e.g. etc"
)
STOP = frozenset(STOP_WORDS.split(" "))
DEFINITION = re.compile(r"^\s*[\w'. -]+ \((?:noun|verb|adjective|adverb)\):")
SAYS_WHAT = re.compile(r"dictionary|wordnet", re.IGNORECASE)
SUGGESTS = re.compile(
    r"what does '|define |synonyms of|a word like|opposite of|in a sentence|what is an? |"
    r"ask me|try '|give me a word", re.IGNORECASE)  # fmt: skip
UNKNOWN = re.compile(r"don't know the word|not a word i know|do not know the word", re.IGNORECASE)
DID_YOU_MEAN = re.compile(r"did you mean '([^']+)'", re.IGNORECASE)
PASTE_TOKENS = 2000
TURN = 4  # the question's turn in measure 2


@dataclass(frozen=True)
class Exchange:
    """An earlier turn of a measure-2 conversation (its reply the corpus's own)."""

    user: str
    reply: str


def first_content_word(definition: str) -> str:
    """The first word of a gloss that is not a stop word ('a large natural stream' -> 'large')."""
    for word in re.findall(r"[A-Za-z][A-Za-z'-]*", definition):
        if word.lower() not in STOP:
            return word.lower()
    return definition.split()[0].lower() if definition.split() else ""


def definition_hit(reply: str, gloss: str) -> bool:
    """Measure 1/2: the reply holds the gloss's first content word."""
    return first_content_word(gloss) in reply.lower()


def persona_ok(reply: str) -> bool:
    """Measure 3: says what the model is or suggests a dictionary question, and is not a
    definition."""
    return not is_definition(reply) and bool(SAYS_WHAT.search(reply) or SUGGESTS.search(reply))


def is_definition(reply: str) -> bool:
    """The reply reads as a dictionary entry ('hello (noun): ...')."""
    return bool(DEFINITION.match(reply))


def says_unknown(reply: str) -> bool:
    """Measure 4: the reply says the word is not known (and is not a definition)."""
    return bool(UNKNOWN.search(reply)) and not is_definition(reply)


def suggested(reply: str) -> str | None:
    """The word a reply's "Did you mean 'Y'?" names, or None."""
    m = DID_YOU_MEAN.search(reply)
    return m.group(1).lower() if m else None


def suggestion_ok(reply: str, word: str, is_lemma: Callable[[str], bool]) -> bool:
    """Measure 4: the named word is a lemma one edit from `word`."""
    named = suggested(reply)
    return named is not None and is_lemma(named) and unknown.distance(word.lower(), named) <= 1


def definition_lemmas(wn: WordNet, n: int, seed: int = 1234) -> dict[str, list[str]]:
    """Measure 1's lemmas: `n` held-out and `n` training lemmas, a seeded sample."""
    rng = random.Random(seed)
    return {"heldout": rng.sample(corpus.lemmas(wn, "heldout"), n),
            "train": rng.sample(corpus.lemmas(wn, "train"), n)}  # fmt: skip


EVERYDAY_SENSES = 4  # tagged senses from which a lemma counts as an everyday word


def everyday_lemmas(wn: WordNet, n: int, seed: int = 7) -> list[str]:
    """`n` training lemmas of one word with at least EVERYDAY_SENSES senses in WordNet's
    sense-tagged text (about 1,500: house, river, book), a seeded sample: the words a new
    user types first."""
    common = sorted(w for w, k in wn.tagged.items()
                    if k >= EVERYDAY_SENSES and w.isalpha() and not corpus.held_out(wn, w))
    return random.Random(seed).sample(common, min(n, len(common)))


def gloss(wn: WordNet, lemma: str) -> str:
    return wn.synsets[wn.senses[lemma][0]].definition


def history(wn: WordNet, maker: pastes.PasteMaker, count_tokens: Callable[[str], int],
            rng: random.Random, avoid: Sequence[str] = ()) -> list[Exchange]:
    """Measure 2's three earlier turns: two other training words' definitions and one pasted
    text of about PASTE_TOKENS tokens (by `count_tokens`), in a seeded order."""
    words = [w for w in rng.sample(corpus.lemmas(wn, "train"), 2 + len(avoid)) if w not in avoid][:2]
    turns = [Exchange(QUESTION.format(w=w), corpus.sense_line(w, wn.synsets[wn.senses[w][0]]))
             for w in words]
    text = maker.text(rng.choice(pastes.STYLES), 4 * PASTE_TOKENS, rng)
    while count_tokens(text) > PASTE_TOKENS:  # trim whole lines to the token count
        text = text.rsplit("\n", 1)[0] if "\n" in text else text[: len(text) * 9 // 10]
    turns.insert(rng.randrange(3), Exchange(text, pastes.reply(maker.lemma_in(text, rng), rng)))
    return turns


def persona_messages(path: Path = PERSONA_FILE) -> list[str]:
    """Measure 3's messages."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def nonword_set(wn: WordNet, sp: unknown.Speller, n: int = 100, seed: int = 29
                ) -> list[tuple[str, str, str | None]]:
    """Measure 4's (non-word, how made, expected suggestion or None), from the evaluation
    share of non-words (never trained on)."""
    rng = random.Random(seed)
    return [(w, how, sp.suggest(w)) for w, how in unknown.nonwords(wn, sp, n, rng, for_eval=True)]


def rate(hits: int, n: int) -> float:
    return hits / n if n else 0.0
