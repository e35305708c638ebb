"""Reading the WordNet 3.0 database: synsets, their glosses, lemmas and pointers.

The source is the Debian package `wordnet-base` (`apt-get download wordnet-base`), given as
the `.deb` file itself (an `ar` archive holding `data.tar.xz`) or as a directory holding the
`data.*` and `index.*` files (`/usr/share/wordnet` where the package is installed).
"""

from __future__ import annotations

import io
import lzma
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

POS_FILES = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}
POS_NAMES = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}
FILES = [f"{kind}.{name}" for name in POS_FILES.values() for kind in ("data", "index")]


@dataclass
class Synset:
    """One synset: its lemmas (display form), gloss split into definition and examples."""

    offset: int
    pos: str  # n v a s r
    lemmas: list[str]
    definition: str
    examples: list[str]
    hypernyms: list[int] = field(default_factory=list)  # offsets (same POS)
    similar: list[int] = field(default_factory=list)  # adjective satellites '&'
    antonyms: list[tuple[int, int]] = field(default_factory=list)  # (offset, lemma index)

    @property
    def key(self) -> tuple[str, int]:
        return (_data_pos(self.pos), self.offset)


@dataclass
class WordNet:
    """Synsets by (pos file, offset) and, per lemma, its senses in frequency order."""

    synsets: dict[tuple[str, int], Synset]
    senses: dict[str, list[tuple[str, int]]]  # lemma -> [(pos file, offset)], most used first
    tagged: dict[str, int]  # lemma -> tagged sense count over its parts of speech


def _data_pos(pos: str) -> str:
    return "a" if pos == "s" else pos


def read_files(source: Path) -> dict[str, bytes]:
    """The eight `data.*`/`index.*` files from a `.deb` or a directory, by name."""
    if source.is_dir():
        return {name: (source / name).read_bytes() for name in FILES}
    raw = source.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise ValueError(f"{source}: not a .deb (ar archive) nor a directory")
    pos = 8
    while pos + 60 <= len(raw):
        name = raw[pos : pos + 16].decode().strip().rstrip("/")
        size = int(raw[pos + 48 : pos + 58].decode().strip())
        body = raw[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            data = lzma.decompress(body) if name.endswith(".xz") else body
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                out = {}
                for member in tar.getmembers():
                    base = member.name.rsplit("/", 1)[-1]
                    if base in FILES and "/wordnet/" in member.name:
                        f = tar.extractfile(member)
                        assert f is not None
                        out[base] = f.read()
                missing = sorted(set(FILES) - set(out))
                if missing:
                    raise ValueError(f"{source}: the package lacks {', '.join(missing)}")
                return out
    raise ValueError(f"{source}: no data.tar member in the package")


def _display(word: str) -> str:
    word = word.replace("_", " ")
    # adjective markers: 'able(a)', 'galore(ip)'
    if word.endswith(")") and "(" in word:
        word = word[: word.index("(")]
    return word


def parse_gloss(gloss: str) -> tuple[str, list[str]]:
    """'a large stream; "the river was navigable"' -> ('a large stream', ['the river was ...'])."""
    parts = [p.strip() for p in gloss.split(";")]
    definition, examples = [], []
    for p in parts:
        if p.startswith('"') and p.endswith('"') and len(p) > 2:
            examples.append(p.strip('"').strip())
        elif p and not examples:
            definition.append(p)
        elif p.startswith('"'):  # an example with a ';' inside it: keep the text whole
            examples.append(p.strip('"').strip())
    return "; ".join(definition), examples


def parse_data(text: str, pos_file: str) -> dict[tuple[str, int], Synset]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith(" "):
            continue  # the licence header
        head, _, gloss = line.partition(" | ")
        f = head.split()
        offset, pos = int(f[0]), f[2]
        n_words = int(f[3], 16)
        lemmas = [_display(f[4 + 2 * i]) for i in range(n_words)]
        i = 4 + 2 * n_words
        n_ptr = int(f[i])
        s = Synset(offset, pos, lemmas, *parse_gloss(gloss.strip()))
        for j in range(n_ptr):
            sym, target, tpos, srctgt = f[i + 1 + 4 * j : i + 5 + 4 * j]
            if sym in ("@", "@i") and _data_pos(tpos) == pos_file:
                s.hypernyms.append(int(target))
            elif sym == "&":
                s.similar.append(int(target))
            elif sym == "!" and _data_pos(tpos) == pos_file:
                s.antonyms.append((int(target), int(srctgt[2:4], 16) - 1))  # sstt: target word
        out[(pos_file, offset)] = s
    return out


def load(source: Path) -> WordNet:
    """Parse the whole database."""
    files = read_files(source)
    synsets: dict[tuple[str, int], Synset] = {}
    senses: dict[str, list[tuple[str, int]]] = {}
    tagged: dict[str, int] = {}
    for pos_file, name in POS_FILES.items():
        synsets.update(parse_data(files[f"data.{name}"].decode("utf-8"), pos_file))
    ranked: dict[str, list[tuple[int, int, list[tuple[str, int]]]]] = {}
    order = list(POS_FILES)
    for pos_file, name in POS_FILES.items():
        for line in files[f"index.{name}"].decode("utf-8").splitlines():
            if not line or line.startswith(" "):
                continue
            f = line.split()
            lemma, n_synsets, n_ptr = _display(f[0]), int(f[2]), int(f[3])
            n_tagged = int(f[5 + n_ptr])
            offsets = [(pos_file, int(x)) for x in f[6 + n_ptr : 6 + n_ptr + n_synsets]]
            ranked.setdefault(lemma, []).append((n_tagged, -order.index(pos_file), offsets))
    for lemma, entries in ranked.items():
        entries.sort(reverse=True)  # the part of speech used most in tagged text first
        senses[lemma] = [o for _, _, offsets in entries for o in offsets]
        tagged[lemma] = sum(e[0] for e in entries)
    return WordNet(synsets, senses, tagged)
