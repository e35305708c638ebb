"""Conversations -> token ids with a loss mask, packed into training sequences.

A conversation is rendered exactly as the engine renders one (ChatML through the engine's
template: `<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n{reply}<|im_end|>\\n`
a turn; a test checks the text against `Tokenizer.render_chat`). Each prompt and reply part
is encoded apart, as the engine sees them (the reply starts right after `assistant\\n`; the
control tokens split the text, so the parts' ids are the whole text's ids). The loss mask
covers every reply and its `<|im_end|>`. An epoch is the conversations in a fresh order, packed
into sequences that each start at a conversation's start (the rest of a row is padding,
masked out); a conversation longer than a row keeps its first `seq_tokens` tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.gguf.tokenizer import Tokenizer
from engine.synth.vocab import VocabSpec
from training import conversations, unknown
from training.conversations import Conversation
from training.corpus import Pair
from training.pastes import PasteMaker
from training.tokenizer import tokenizer_of, train_vocab
from training.wordnet import WordNet


@dataclass
class Encoded:
    """Every conversation's ids back to back, with offsets and the loss mask."""

    ids: np.ndarray  # [N] uint16
    mask: np.ndarray  # [N] bool: a reply token (or its <|im_end|>)
    starts: np.ndarray  # [C + 1] int64 offsets of each conversation
    turn_tokens: np.ndarray  # [E] int32 tokens of each exchange (prompt and reply), in order

    @property
    def n_conversations(self) -> int:
        return len(self.starts) - 1


def render(pair: Pair) -> tuple[str, str]:
    """(prompt part, reply part) of one exchange in ChatML."""
    prompt = f"<|im_start|>user\n{pair.user}<|im_end|>\n<|im_start|>assistant\n"
    return prompt, f"{pair.reply}<|im_end|>\n"


def messages(conv: Conversation) -> list[dict[str, str]]:
    """The conversation as the chat template reads it."""
    return [m for p in conv for m in ({"role": "user", "content": p.user},
                                      {"role": "assistant", "content": p.reply})]


ENCODE_BATCH = 20_000  # conversations encoded at once: Python lists of ids are 8x numpy's size


def encode(tok: Tokenizer, convs: Sequence[Conversation]) -> Encoded:
    """Token ids of every conversation, the loss on every reply (not the '\\n' after it)."""
    parts = [_encode(tok, convs[i : i + ENCODE_BATCH]) for i in range(0, len(convs), ENCODE_BATCH)]
    lengths = np.concatenate([np.diff(e.starts) for e in parts])
    return Encoded(
        np.concatenate([e.ids for e in parts]),
        np.concatenate([e.mask for e in parts]),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        np.concatenate([e.turn_tokens for e in parts]),
    )


def _encode(tok: Tokenizer, convs: Sequence[Conversation]) -> Encoded:
    enc = tok.encode_many([t for c in convs for p in c for t in render(p)])
    ids, mask, starts, turns = [], [], [0], []
    k = 0
    for conv in convs:
        n = 0
        for _ in conv:
            prompt, reply = enc[k], enc[k + 1]
            k += 2
            ids += (prompt, reply)
            m = np.zeros(len(prompt) + len(reply), dtype=bool)
            m[len(prompt) : len(prompt) + len(reply) - 1] = True
            mask.append(m)
            turns.append(len(m))
            n += len(m)
        starts.append(starts[-1] + n)
    return Encoded(
        np.concatenate([np.asarray(x, dtype=np.uint16) for x in ids]),
        np.concatenate(mask),
        np.asarray(starts, dtype=np.int64),
        np.asarray(turns, dtype=np.int32),
    )


def epoch(enc: Encoded, seq_tokens: int, rng: np.random.Generator, pad_id: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """One epoch: (ids [S, seq_tokens] int64, mask [S, seq_tokens]) in a random conversation
    order, each row starting at a conversation's start."""
    order = rng.permutation(enc.n_conversations)
    lengths = np.minimum(np.diff(enc.starts), seq_tokens)[order]
    rows: list[list[int]] = []  # conversation indices (into `order`) a row
    used = seq_tokens
    for j, n in enumerate(lengths.tolist()):
        if used + n > seq_tokens:
            rows.append([])
            used = 0
        rows[-1].append(j)
        used += n
    ids = np.full((len(rows), seq_tokens), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), seq_tokens), dtype=bool)
    for r, row in enumerate(rows):
        at = 0
        for j in row:
            c, n = order[j], int(lengths[j])
            s = enc.starts[c]
            ids[r, at : at + n] = enc.ids[s : s + n]
            mask[r, at : at + n] = enc.mask[s : s + n]
            at += n
    return ids, mask


@dataclass
class Prepared:
    """The data step's output: the vocabulary, its tokenizer, each phrasing's ids, stats."""

    vocab: VocabSpec
    tok: Tokenizer
    encoded: list[Encoded]
    stats: dict


def prepare(wn: WordNet, seed: int, n_phrasings: int, n_vocab: int,
            mix: conversations.Mix | None = None) -> Prepared:
    """The whole data step of a build: conversations of `n_phrasings` phrasings (seeds
    `seed`, `seed + 1`, ...), a tokenizer trained on the first, every phrasing encoded."""
    t0 = time.perf_counter()
    sp, pastes = unknown.Speller(wn), PasteMaker(wn)
    mix = mix or conversations.Mix()
    phrasings = [conversations.build(wn, seed + k, mix, sp, pastes) for k in range(n_phrasings)]
    t_corpus = time.perf_counter() - t0
    vocab = train_vocab((t for c in phrasings[0] for p in c for t in (p.user, p.reply)), n_vocab)
    tok = tokenizer_of(vocab)
    encoded = [encode(tok, convs) for convs in phrasings]
    stats = statistics(phrasings[0], encoded[0])
    stats["seconds"] = {"corpus": round(t_corpus, 1), "total": round(time.perf_counter() - t0, 1)}
    return Prepared(vocab, tok, encoded, stats)


def kind_of(pair: Pair) -> str:
    """The kind of an exchange, its family only ('unknown', 'persona', 'paste', 'define')."""
    return pair.kind.split("-", 1)[0]


def statistics(convs: Sequence[Conversation], enc: Encoded) -> dict:
    """Counts per kind of exchange, conversation lengths and tokens of one phrasing (all
    and by family of exchange)."""
    kinds = Counter(p.kind for c in convs for p in c)
    family_tokens: Counter[str] = Counter()
    for p, n in zip((p for c in convs for p in c), enc.turn_tokens.tolist(), strict=True):
        family_tokens[kind_of(p)] += n
    turns = Counter(len(c) for c in convs)
    lengths = np.diff(enc.starts)
    return {
        "conversations": len(convs), "exchanges": sum(kinds.values()),
        "by_kind": dict(sorted(kinds.items())),
        "by_family": dict(sorted(Counter(kind_of(p) for c in convs for p in c).items())),
        "turns": dict(sorted(turns.items())),
        "tokens": len(enc.ids), "loss_tokens": int(enc.mask.sum()),
        "tokens_by_family": dict(sorted(family_tokens.items())),
        "conversation_tokens": {"median": int(np.median(lengths)), "max": int(lengths.max()),
                                "over_4096": int((lengths > 4096).sum())},
    }  # fmt: skip
