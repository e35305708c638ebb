"""Chat pairs -> token ids with a loss mask, packed into training sequences.

A pair is one ChatML exchange, exactly as the engine renders a conversation:
`<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n{reply}<|im_end|>\\n`. The loss
mask covers the reply and its `<|im_end|>` (what the model must generate). An epoch is the
pairs in a fresh random order, concatenated (consecutive exchanges read as one conversation)
and cut into sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.gguf.tokenizer import Tokenizer
from training.corpus import Pair


@dataclass
class Encoded:
    """Every pair's ids back to back, with offsets and the loss mask."""

    ids: np.ndarray  # [N] uint16
    mask: np.ndarray  # [N] bool: a reply token (or its <|im_end|>)
    starts: np.ndarray  # [P + 1] int64 offsets of each pair

    @property
    def n_pairs(self) -> int:
        return len(self.starts) - 1


def render(pair: Pair) -> tuple[str, str]:
    """(prompt part, reply part) of one exchange in ChatML."""
    prompt = f"<|im_start|>user\n{pair.user}<|im_end|>\n<|im_start|>assistant\n"
    return prompt, f"{pair.reply}<|im_end|>\n"


def encode(tok: Tokenizer, pairs: list[Pair]) -> Encoded:
    """Token ids of every pair (the prompt and reply parts encoded apart, as the engine sees
    them: the reply starts right after `assistant\\n`)."""
    texts = [t for p in pairs for t in render(p)]
    enc = tok.encode_many(texts)
    ids, mask, starts = [], [], [0]
    for prompt, reply in zip(enc[0::2], enc[1::2]):
        ids.append(prompt)
        ids.append(reply)
        m = np.zeros(len(prompt) + len(reply), dtype=bool)
        m[len(prompt) : len(prompt) + len(reply) - 1] = True  # not the trailing '\n'
        mask.append(m)
        starts.append(starts[-1] + len(m))
    return Encoded(
        np.concatenate([np.asarray(x, dtype=np.uint16) for x in ids]),
        np.concatenate(mask),
        np.asarray(starts, dtype=np.int64),
    )


def epoch(enc: Encoded, seq_tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One epoch: (ids [S, seq_tokens] int64, mask [S, seq_tokens]) in a random pair order."""
    order = rng.permutation(enc.n_pairs)
    idx = np.concatenate([np.arange(enc.starts[i], enc.starts[i + 1]) for i in order])
    n = len(idx) // seq_tokens * seq_tokens
    idx = idx[:n].reshape(-1, seq_tokens)
    return enc.ids[idx].astype(np.int64), enc.mask[idx]
