"""Deterministic byte-level BPE vocabulary for synthetic models: random output reads as words.

Layout of ids: the 256 byte tokens (id = byte value), then the merged tokens in merge order,
then padding tokens, then `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.

The merges come from BPE training (the `tokenizers` trainer, with the same qwen2
pre-tokenizer the engine encodes with) on the embedded word list in four spellings (`word`,
` word`, `Word`, ` Word`) plus common punctuation runs, weighted by list rank so frequent
words finish first. Training until no pair is left makes every word one token, and encoding a
training word replays the training merges, so each word encodes to its own token. Padding
tokens are pairs of space-led words (`Ġtheir` + `Ġgarden`); their merges rank after every
trained merge, so they never change how a listed word encodes.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from importlib import resources

import gguf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from engine.errors import ModelError
from engine.gguf.chat_template import CHATML_TEMPLATE
from engine.gguf.tokenizer import TokenType, bytes_to_unicode, make_pre_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_N_VOCAB = 256 + len(SPECIAL_TOKENS)
MAX_N_VOCAB = 1 << 20
PRE = "qwen2"

# Punctuation and whitespace runs the qwen2 regex keeps as one piece; heavy weights so they
# merge early (".\n" endings make the demo's random text look like prose).
PUNCTUATION = (
    ".\n", ".\n\n", "\n\n", "\n\n\n", ",\n", ":\n", "?\n", "!\n", "...", " ...", " -", " --",
    " —", "—", " –", " (", ")", "),", ").", " \"", "\"", "\",", "\".", "'s", "'t", "'re", "'ve",
    "'m", "'ll", "'d", " '", "'", ":", ";", "?", "!", " [", "]", " {", "}", " =", " +", " *",
    " #", " ##", "**", " **", "```", " `", "`", "://", " /", "  ", "   ", "    ", "\t", " &",
    " <", ">", " >",
)  # fmt: skip
PUNCTUATION_WEIGHT = 64
MAX_WORD_WEIGHT = 48


@dataclass(frozen=True)
class VocabSpec:
    """A complete GGUF `gpt2` vocabulary. `words` lists the words of the embedded list that
    are whole tokens in both spellings (`word` and ` word`)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    chat_template: str
    words: tuple[str, ...] = ()

    @classmethod
    def chatml(cls, tokens: list[str], merges: list[str], words: tuple[str, ...] = ()) -> VocabSpec:
        """`tokens` (bytes and merged tokens) then the special tokens, `<|endoftext|>` as BOS,
        EOS and padding, and the ChatML template."""
        n_regular = len(tokens)
        types = [int(TokenType.NORMAL)] * n_regular + [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
        return cls(
            tokens=[*tokens, *SPECIAL_TOKENS],
            token_types=types,
            merges=merges,
            bos_id=n_regular,
            eos_id=n_regular,
            pad_id=n_regular,
            chat_template=CHATML_TEMPLATE,
            words=words,
        )

    @property
    def n_vocab(self) -> int:
        """Number of tokens, specials included."""
        return len(self.tokens)

    @property
    def im_start_id(self) -> int:
        """Id of `<|im_start|>`."""
        return self.n_vocab - 2

    @property
    def im_end_id(self) -> int:
        """Id of `<|im_end|>`."""
        return self.n_vocab - 1


@functools.cache
def word_list() -> tuple[str, ...]:
    """The embedded common-English word list, most frequent first."""
    text = resources.files("engine.synth").joinpath("words.txt").read_text(encoding="utf-8")
    return tuple(w for w in (line.strip() for line in text.splitlines()) if w)


def _training_text(n_words: int) -> list[str]:
    # Each punctuation run is its own sequence (glued together, runs would fuse into one
    # long piece); each word spelling is one sequence repeated by weight, where ' ' starts
    # a new piece and '\n' is a piece of its own, never part of a pair. Weights depend on the
    # rank in the whole list, so a shorter list is a prefix of the same corpus.
    out = [piece for piece in PUNCTUATION for _ in range(PUNCTUATION_WEIGHT)]
    words = word_list()
    n = len(words)
    for rank, word in enumerate(words[:n_words]):
        weight = 1 + (n - rank) * (MAX_WORD_WEIGHT - 1) // n
        cap = word[0].upper() + word[1:]
        out.append((" " + word) * (2 * weight))
        out.append("\n".join([word] * weight))
        out.append((" " + cap) * weight)
        out.append("\n".join([cap] * max(1, weight // 2)))
    return out


@functools.lru_cache(maxsize=64)
def _trained_merges(n_words: int, max_tokens: int | None = None) -> tuple[tuple[str, str], ...]:
    """BPE merges, in rank order, trained on punctuation and the first `n_words` words until
    no pair is left (or until `max_tokens` merged tokens exist)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = make_pre_tokenizer(PRE)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + (max_tokens if max_tokens is not None else MAX_N_VOCAB),
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    hf.train_from_iterator(_training_text(n_words), trainer=trainer)
    raw = json.loads(hf.to_str())["model"]["merges"]
    # older `tokenizers` serialise a merge as "a b", newer as ["a", "b"]
    return tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in raw)


def _n_tokens(n_words: int) -> int:
    return len({a + b for a, b in _trained_merges(n_words)})


def _spellings_lower_bound(n_words: int) -> int:
    # Every multi-symbol spelling of a word becomes a token, so full training makes at least
    # this many; it spares training on the whole list when the budget is clearly smaller.
    b2u = bytes_to_unicode()
    spellings = set()
    for word in word_list()[:n_words]:
        cap = word[0].upper() + word[1:]
        for text in (word, " " + word, cap, " " + cap):
            symbols = "".join(b2u[b] for b in text.encode("utf-8"))
            if len(symbols) > 1:
                spellings.add(symbols)
    return len(spellings)


def _fit_merges(budget: int) -> tuple[tuple[str, str], ...]:
    """Merges of the longest word-list prefix whose fully trained tokens fit `budget`
    (within 1% of the words); a budget too small for punctuation gets a cut-short training."""
    n = len(word_list())
    t_hi = _spellings_lower_bound(n)
    if budget >= t_hi:
        t_hi = _n_tokens(n)
        if t_hi <= budget:
            return _trained_merges(n)
    if _n_tokens(0) > budget:
        return _trained_merges(0, budget)
    lo, hi = 0, n  # _n_tokens(lo) <= budget < _n_tokens(hi); t_hi may be a lower bound
    while hi - lo > max(1, lo // 100):
        t_lo = _n_tokens(lo)
        guess = lo + (hi - lo) * (budget - t_lo) // max(1, t_hi - t_lo)
        mid = min(max(guess, lo + 1), hi - 1)
        t_mid = _n_tokens(mid)
        if t_mid <= budget:
            lo = mid
        else:
            hi, t_hi = mid, t_mid
    return _trained_merges(lo)


def build_vocab(n_vocab: int, seed: int = 0) -> VocabSpec:
    """A vocabulary of exactly `n_vocab` tokens; `seed` picks the word-pair padding tokens."""
    if not MIN_N_VOCAB <= n_vocab <= MAX_N_VOCAB:
        raise ModelError(
            f"synthetic vocabulary size {n_vocab} is outside {MIN_N_VOCAB}..{MAX_N_VOCAB}"
        )
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    index = {t: i for i, t in enumerate(tokens)}
    merges: list[str] = []
    n_regular = n_vocab - len(SPECIAL_TOKENS)
    for left, right in _fit_merges(n_regular - 256):
        merged = left + right
        merges.append(f"{left} {right}")
        if merged not in index:  # two merges may build the same text; it is one token
            index[merged] = len(tokens)
            tokens.append(merged)
    words = tuple(w for w in word_list() if w in index and _space(w) in index)
    pool = [_space(w) for w in words] if len(words) >= 8 else tokens
    _pad_with_pairs(tokens, index, merges, pool, n_regular, seed)
    assert len(tokens) == n_regular, (len(tokens), n_regular)
    return VocabSpec.chatml(tokens, merges, words)


def _space(word: str) -> str:
    return "Ġ" + word  # byte-level spelling of " word"


def _pad_with_pairs(
    tokens: list[str],
    index: dict[str, int],
    merges: list[str],
    pool: list[str],
    n_target: int,
    seed: int,
) -> None:
    # Pairs of space-led words: the qwen2 regex never keeps two words in one piece, so these
    # merges never fire when encoding, but each token is reachable and decodes to two words.
    n_missing = n_target - len(tokens)
    if n_missing <= 0:
        return
    if len(pool) * len(pool) < 2 * n_missing:
        raise ModelError(
            f"synthetic vocabulary size {n_target + len(SPECIAL_TOKENS)} is too large for "
            f"{len(pool)} padding pieces; use at most {len(pool) ** 2 // 2 + len(tokens)} tokens"
        )
    pool = list(pool)  # `tokens` grows below; sample from a fixed copy
    rng = random.Random(seed)
    while len(tokens) < n_target:
        left, right = rng.choice(pool), rng.choice(pool)
        merged = left + right
        if merged in index:
            continue
        index[merged] = len(tokens)
        tokens.append(merged)
        merges.append(f"{left} {right}")


def write_vocab(writer: gguf.GGUFWriter, spec: VocabSpec, pre: str = PRE) -> None:
    """Write the vocabulary as GGUF `tokenizer.*` metadata (gpt2 model, the qwen2
    pre-tokenizer unless `pre` names another)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.token_types)
    writer.add_token_merges(spec.merges)
    writer.add_bos_token_id(spec.bos_id)
    writer.add_eos_token_id(spec.eos_id)
    writer.add_pad_token_id(spec.pad_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(spec.chat_template)
