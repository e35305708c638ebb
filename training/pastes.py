"""Long pasted texts that are not dictionary questions, made only from WordNet's own words
(glosses, examples, lemmas) and phrasing written for this project: licence-like clauses,
code-like listings and prose of shuffled glosses and examples. The reply says it is a long
text, not a word the model knows, and offers to define a word from it, naming a real lemma
that occurs in it.
"""

from __future__ import annotations

import random
import re

from training.corpus import Pair
from training.wordnet import WordNet

STYLES = ("licence", "code", "prose")
CLAUSES = (
    "{N}. {T}. The {a} shall not be held liable for any {b} arising from the use of the {c}.",
    ("{N}. {T}. Permission is granted to copy and distribute the {a}, provided that this notice "
    "and the {b} are kept in every copy."),
    ("{N}. {T}. THE {A} IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND, INCLUDING ANY "
    "{B} OR {C}."),
    ("{N}. {T}. Each {a} may terminate this agreement if the {b} fails to comply with the "
    "terms of the {c}."),
    "{N}. {T}. Redistribution of the {a} in any form requires the written consent of the {b}.",
    "{N}. {T}. Nothing in this section limits the {a} of the {b} under applicable {c}.",
)  # fmt: skip
CODE_LINES = (
    "def {f}({x}, {y}):", "    {x} = {y}.{f}()", "    if not {x}:", "        return None",
    "    for {z} in {x}:", "        {y}.append({z})", "    return {x}", "class {C}:",
    "    def __init__(self, {x}):", "        self.{x} = {x}", "import {x}", "from {x} import {y}",
    "{x} = {f}({y}, {n})", "# {gloss}", "    while {x} < {n}:", "        {x} += 1",
    "print({x})", "    raise ValueError(\"{gloss}\")", "",
)  # fmt: skip
REPLIES = (
    "That is a long text, not a word I know. I can define a word from it; try: What does '{w}' mean?",
    ("This looks like a long pasted text; I only know single words. Ask me about one in it, "
    "for example: What does '{w}' mean?"),
    ("That is a long text, not a dictionary question. I'm a small dictionary model: I can tell "
    "you what a word from it means, like '{w}'."),
    ("I can't read long texts; I'm a dictionary. Pick a word from it and I'll define it, "
    "for example '{w}'."),
)  # fmt: skip
STOP_WORDS = "the and for any this that with from are its not all may shall each use under into"
STOP = frozenset(STOP_WORDS.split(" "))


class PasteMaker:
    """Long texts from one WordNet: the glosses and the everyday single-word lemmas."""

    def __init__(self, wn: WordNet) -> None:
        self.wn = wn
        self.glosses = [s.definition for s in wn.synsets.values() if s.definition]
        self.examples = [e for s in wn.synsets.values() for e in s.examples]
        self.words = sorted(w for w, n in wn.tagged.items() if n and w.isalpha() and len(w) >= 4)
        if not self.words:  # a small WordNet: any single-word lemma
            self.words = sorted(w for w in wn.senses if w.isalpha() and len(w) >= 3)

    def _ident(self, rng: random.Random) -> str:
        return "_".join(rng.choice(self.words) for _ in range(rng.choice((1, 1, 2))))

    def text(self, style: str, n_chars: int, rng: random.Random) -> str:
        """A text of about `n_chars` characters (at least that many, one unit more at most)."""
        lines: list[str] = []
        size = 0
        while size < n_chars:
            if style == "licence":
                a, b, c = (rng.choice(self.words) for _ in range(3))
                line = rng.choice(CLAUSES).format(
                    N=len(lines) + 1, T=rng.choice(self.words).capitalize(), a=a, b=b, c=c,
                    A=a.upper(), B=b.upper(), C=c.upper())
            elif style == "code":
                line = rng.choice(CODE_LINES).format(
                    f=self._ident(rng), x=self._ident(rng), y=self._ident(rng),
                    z=rng.choice(self.words), C=rng.choice(self.words).capitalize(),
                    n=rng.randrange(2, 1000), gloss=rng.choice(self.glosses))
            else:
                k = rng.randrange(2, 6)
                parts = [rng.choice(self.glosses if rng.random() < 0.6 else self.examples or
                                    self.glosses) for _ in range(k)]
                line = " ".join(p[:1].upper() + p[1:] + "." for p in parts)
            lines.append(line)
            size += len(line) + 1
        text = "\n".join(lines)
        if not self._lemmas(text):  # a few glosses may hold no lemma of ours: name one
            text += f"\nSee also: {rng.choice(self.words)}."
        return text

    def _lemmas(self, text: str) -> list[str]:
        return sorted({w for w in re.findall(r"[a-z]{3,}", text.lower())
                       if w in self.wn.senses and w not in STOP})  # fmt: skip

    def lemma_in(self, text: str, rng: random.Random) -> str:
        """A real lemma that occurs in `text` as a word (an everyday one where there is one)."""
        found = self._lemmas(text)
        everyday = [w for w in found if self.wn.tagged.get(w)]
        pool = everyday or found
        assert pool, "a paste made of WordNet text always holds a lemma"
        return rng.choice(pool)

    def pair(self, rng: random.Random, min_chars: int = 400, max_chars: int = 10_000) -> Pair:
        """A paste of a random style and length (log-uniform in chars) and its reply."""
        n = int(min_chars * (max_chars / min_chars) ** rng.random())
        style = rng.choice(STYLES)
        text = self.text(style, n, rng)
        return Pair(text, reply(self.lemma_in(text, rng), rng), "", f"paste-{style}")


def reply(lemma: str, rng: random.Random) -> str:
    """The answer to a long text: what it is, and a word from it to ask about."""
    return rng.choice(REPLIES).format(w=lemma)
